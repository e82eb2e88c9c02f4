"""OBSERVE: a JSON-lines record of every write and token of a run, with a receipt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from .. import ast, limits
from ..binding import SliceBinding, check_output, internals, internals_data, with_text
from ..layouts import intervention, prompt_text, time
from ..planner import BoundPrompt, Context, Node, bind_prompt, depth_of, err, run_words
from ..registry import family
from ..results import InternalsPrompt, Result
from ..syntax import Children, Clause
from ..text import fields, fmt_text, fmt_value, layers_phrase

fam = family("records", module=__name__, statements=("observe_stmt",), path_keywords=("INTO",), grammar=r"""
// OBSERVE: a JSON-lines record of every write of a run, with a receipt.
observe_stmt: OBSERVE prompt observe_option* RECORD INTO STRING

?observe_option: generate_clause
               | lens_clause
               | draft_clause
               | ablate_clause

lens_clause: LENS _LPAR token_ref (_COMMA token_ref)* _RPAR
""")

fam.doc('OBSERVE',
        "OBSERVE 'prompt' | TOKENS (ids) [GENERATE n] [LENS ('token', ...)] [DRAFT DEPTH n] [ABLATE FEATURES (L:f, ...)] RECORD INTO 'run.jsonl'",
        'a JSON-lines record of every write and token of a run, with a receipt (vindex3 record verify)',
        "OBSERVE 'Hello' GENERATE 4 RECORD INTO 'run.jsonl';", order=220)


@fam.rule
def observe_stmt(c: Children) -> Observe:
    fields = c.options("OBSERVE")
    if "generate" in fields:
        fields["generate"] = fields["generate"][0]  # OBSERVE always generates n tokens; EXACTLY says so
    return Observe(prompt=c.get("OBSERVE"), into=c.string("RECORD", "INTO"), **fields)


@fam.rule
def lens_clause(c: Children) -> Clause:
    return c.clause("lens", c.values(), "LENS")


class Observe(ast.Statement):
    """OBSERVE 'text' [GENERATE n] [LENS ('tok', ...)] [DRAFT DEPTH n] [ABLATE FEATURES (...)]
    RECORD INTO 'run.jsonl'."""

    keyword: ClassVar[str] = "OBSERVE"
    paths: ClassVar[tuple[str, ...]] = ("into",)
    read_only: ClassVar[bool | str] = "it writes a record file on the server"
    needs_container: ClassVar[bool] = True
    kind: Literal["observe"] = "observe"
    prompt: ast.Prompt
    generate: int | None = None
    lens: list[str | int] = []  # noqa: RUF012 (pydantic copies the default per instance)
    depth: int | None = None
    ablate: ast.Ablation | None = None
    into: str
    overwrite: bool = False  # replace an existing record

    def check(self) -> None:
        if self.generate is not None and self.generate < 0:  # the grammar takes whole numbers; kept for clarity
            raise err(self, f"GENERATE must be at least 0, got {self.generate}")


@dataclass(frozen=True, eq=False)
class ObservePlan(Node):
    slice: SliceBinding
    prompt: BoundPrompt
    generate: int
    lens: tuple[int, ...]
    into: str
    overwrite: bool
    intervention: Any


@fam.plans(Observe)
def plan_observe(s: Observe, ctx: Context) -> Node:
    cat = ctx.catalog
    limits.check_count(s.generate, "max_generate", ctx.settings, "GENERATE", "tokens")  # before anything runs
    sl = cat.bind_slice(depth_of(ctx, s.depth))
    ablation = cat.ablation(s.ablate, sl)
    lens = tuple(cat.single_token(t, "OBSERVE ... LENS") for t in s.lens)
    prompt = bind_prompt(ctx, s.prompt)
    p, g = len(prompt.ids), s.generate or 0
    limits.check_positions(p + g, cat.context_length, ctx.settings, run_words("OBSERVE", p, g))
    steps = cat.estimate(1, sl.depth, start=p + g - 2) if g > 1 else None
    limits.Need().add("the largest pass", limits.largest(cat.estimate(p, sl.depth), steps)).check(ctx.settings, "OBSERVE")
    return ObservePlan(s, slice=sl, prompt=prompt, generate=g, lens=lens,
                       into=s.into, overwrite=bool(s.overwrite or ctx.settings.overwrite),
                       intervention=ablation)


class ObserveResult(Result):
    """OBSERVE: the record written and its receipt (a mirror of vindex3.internals' model)."""

    kind: Literal["observe"] = "observe"
    path: str
    run_id: str
    prompt: InternalsPrompt
    generated_ids: list[int]
    generated_text: str | None
    slice: str
    executed_layers: list[int]
    intervention: dict[str, Any] | None
    lens_tokens: list[int]
    events: int
    write_events: int
    token_events: int
    sha256: str
    status: Literal["complete", "interrupted"]
    seconds: float


@fam.runs(ObservePlan)
def run_observe(session, node: ObservePlan) -> ObserveResult:
    check_output(session, node.into, "OBSERVE ... RECORD INTO", node.overwrite)
    r = internals(session).observe(list(node.prompt.ids), node.into, generate=node.generate,
                                   lens_tokens=list(node.lens), overwrite=node.overwrite, slice=node.slice.depth,
                                   intervention=node.intervention, activations=session.settings.activations)
    return ObserveResult.model_validate(with_text(internals_data(r), node.prompt))


@fam.layout(ObserveResult)
def layout_observe(r: ObserveResult, timing: bool) -> list[str]:
    out = [f"recorded {prompt_text(r.prompt)} into {r.path}: {r.status}"]
    n = len(r.generated_ids)
    out += fields([
        ("slice", f"{r.slice} ({layers_phrase(r.executed_layers)})"),
        ("ablated", intervention(r.intervention)),
        ("generated", None if not n else f"{n} token{'' if n == 1 else 's'} {fmt_value(r.generated_ids)} "
                                         f"{fmt_text(r.generated_text) if r.generated_text is not None else ''}".rstrip()),
        ("lens", None if not r.lens_tokens else fmt_value(r.lens_tokens)),
        ("events", f"{r.events:,} ({r.write_events:,} writes, {r.token_events:,} tokens)"),
        ("receipt", f"sha256 {r.sha256}, run {r.run_id}"),
        ("check", f"vindex3 record verify {r.path}"),
        time(r.seconds, timing),
    ])
    return out
