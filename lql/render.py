"""The one renderer. Results → text (aligned fields and tables, fitted to a width or laid out
one field per line), JSON (one object per statement, stable keys), rows for CSV, TSV,
Markdown and JSON lines, HTML for notebooks, a ladder chart; and errors → text (the one
error formatter every front end uses) and JSON (one shape for syntax errors and refusals).
Layout only: nothing here computes a fact, opens a container or touches a model.

Machine-dependent values (timings) are rendered with a unit (``12.3 ms``, ``0.004 s``,
``250.1 tok/s``) and only when the ``timing`` setting is on, so that text output is otherwise
reproducible."""

from __future__ import annotations

import csv
import html
import io
import re
from collections.abc import Callable, Sequence
from typing import Any

from . import results as R

#: Output formats, as ``SET format``, ``\T`` and ``lql --format`` name them.
FORMATS = ("text", "json", "csv", "tsv", "markdown", "jsonl")

from .layouts import (
    generated,
    intervention,
    operand_rows,
    placement,
    prompt_fields,
    reads,
    shares,
    short,
    summary_fields,
    table_with_banners,
    timing_fields,
)
from .text import (  # noqa: F401
    Col,
    _wants_vertical,
    binary_size,
    fields,
    fitting,
    fmt_bpw,
    fmt_bytes,
    fmt_int,
    fmt_layers,
    fmt_mix,
    fmt_mixed,
    fmt_params,
    fmt_prob,
    fmt_seconds,
    fmt_shape,
    fmt_text,
    fmt_value,
    layers_phrase,
    num,
    table,
    vertical,
)

# ---- per-result layouts ---------------------------------------------------------------

_LAYOUTS: dict[type, Callable[[Any, bool], list[str]]] = {}


def _layout(cls: type):
    def deco(fn):
        _LAYOUTS[cls] = fn
        return fn

    return deco


@_layout(R.ExplainResult)
def _explain(r: R.ExplainResult, timing: bool) -> list[str]:
    return _explain_plan(r) + placement(r.placement)


def _explain_plan(r: R.ExplainResult) -> list[str]:
    head = f"plan: {r.slice}, {layers_phrase(r.executed_layers)} of {r.model_layers}"
    out = [head]
    if r.skipped_layers:
        out.append(f"not run: {layers_phrase(r.skipped_layers)}")
    if r.prompt is not None:
        out += fields([
            ("runs", r.operation),
            ("prompt", (fmt_text(r.prompt.text) if r.prompt.text is not None else "token ids")
             + (" in the chat template" if r.prompt.chat else "")),
            ("token ids", fmt_value(r.prompt.ids)),
            ("state after prompt", fmt_bytes(r.state_bytes_after_prompt)),
        ])
    headers = ["op", "role", "operand", "tensor", "dtype", "shape", num("bytes"), "params"]
    rows: list[list[str]] = []
    for st in r.steps:
        if st.stage == "layer":
            # the mixer's own parameters head the layer; its row then needs no params column
            mixer = next((op for op in st.ops if op.role == "mixer"), None)
            params = mixer.params if mixer is not None else st.params
            title = f"layer {st.layer}: {st.operator}"
            state = st.geometry or "-"
            if st.bytes_per_position:
                state += f", {st.bytes_per_position:,} bytes/position"
            if st.fixed_bytes:
                state += f", {st.fixed_bytes:,} bytes fixed"
            rows.append([f"[{title}; state {state}]"] + [""] * 7)
            if params:
                rows.append([f"[  {fmt_params(params)}]"] + [""] * 7)
            for role, d in ((st.reads or {}).get("detail") or {}).items():
                if isinstance(d, dict) and "experts" in d and "top_k" in d:
                    rows.append([f"[  {role} {d.get('operator', '')}: {_expert_reads(d)}]"] + [""] * 7)
            rows += operand_rows(st.ops, with_params=True, skip_params_of="mixer")
        else:
            rows.append([f"[{st.stage.replace('_', ' ')}]"] + [""] * 7)
            rows += operand_rows(st.ops, with_params=True)
    out += [""] + table_with_banners(headers, rows)
    c = r.reads
    out += [""] + fields([
        ("reads", f"{c.total_reads} operands, {fmt_bytes(c.total_bytes)}"),
        ("  ends", f"{c.ends_reads} operands, {fmt_bytes(c.ends_bytes)} (embedding, final norm, head)"),
        ("  layers", f"{c.layer_reads} operands, {fmt_bytes(c.layer_bytes)}"),
    ] + [(f"  {e.encoding}", f"{e.tensors} tensors, {fmt_bytes(e.bytes)}, {fmt_bpw(e.bits_per_weight)} bits/weight")
         for e in c.by_encoding])
    return out + reads(r.per_position, "per position (a token reads)")


def _expert_reads(d: dict) -> str:
    """A routed FFN's read detail: 'top 3 of 10 experts (softmax_topk); a token reads 40,380
    bytes = 1,800 always + 3 x 12,860 per expert, of a 128,600-byte bank'."""
    return (f"top {d['top_k']} of {d['experts']} experts ({d.get('router', '?')}); a token reads "
            f"{fmt_int(d.get('bytes_per_position'))} bytes = {fmt_int(d.get('always_bytes'))} always + {d['top_k']} x "
            f"{fmt_int(d.get('bytes_per_expert'))} per expert, of a {fmt_int(d.get('expert_bank_bytes'))}-byte bank")


_LONG_LIST = 8  # a provenance list longer than this is summarised in text (JSON keeps every entry)


@_layout(R.InferResult)
def _infer(r: R.InferResult, timing: bool) -> list[str]:
    out = fields([("slice", f"{r.slice} ({layers_phrase(r.executed_layers)})"), *prompt_fields(r.prompt),
                  ("ablated", intervention(r.intervention))])
    if r.top is not None:
        out += [""] + table(
            [num("rank"), "token", num("id"), num("probability")],
            [[str(c.rank), fmt_text(c.token), str(c.id), fmt_prob(c.probability)] for c in r.top],
        )
    if r.generated_ids is not None:
        out += [""] + fields([
            ("generated", generated(len(r.generated_ids), r.interrupted, r.stopped_at)),
            ("ids", fmt_value(r.generated_ids)),
            ("text", fmt_text(r.generated_text) if r.generated_text is not None else None),
        ])
    if r.expert_layers and r.prefill_bytes is not None:
        # reads depend on the routing: what the prefill and the decode steps touched
        dec = r.decode_bytes or []
        out += [""] + fields([
            ("bytes read", f"prefill {fmt_bytes(r.prefill_bytes)}"),
            ("  per decode step", f"{fmt_int(round(sum(dec) / len(dec)))} bytes (mean of {len(dec)}; min "
                                  f"{fmt_int(min(dec))}, max {fmt_int(max(dec))})" if dec else None),
        ])
    if timing and r.timing is not None:
        out += [""] + timing_fields(r.timing)
    return out


@_layout(R.SpeculateResult)
def _speculate(r: R.SpeculateResult, timing: bool) -> list[str]:
    if r.interrupted:
        return fields([
            *prompt_fields(r.prompt),
            ("draft", f"depth {r.depth}, lookahead {r.lookahead}"),
            ("generated", generated(len(r.generated_ids), True)),
            ("ids", fmt_value(r.generated_ids)),
            ("text", fmt_text(r.generated_text) if r.generated_text is not None else None),
        ])
    out = fields([
        *prompt_fields(r.prompt),
        ("draft", f"depth {r.depth}, lookahead {r.lookahead}, rollback by {r.rollback}"),
        ("generated", f"{len(r.generated_ids)} tokens"),
        ("ids", fmt_value(r.generated_ids)),
        ("text", fmt_text(r.generated_text) if r.generated_text is not None else None),
        ("acceptance", f"{r.accepted} of {r.proposed} proposed tokens ({r.acceptance_rate:.3f})"),
        ("full-model calls", f"{r.full_model_calls} ({r.tokens_per_full_step:.2f} tokens per call)"),
        ("same as greedy", None if r.matches_plain is None else ("yes" if r.matches_plain else "NO")),
    ])
    if timing and r.timing is not None:
        out += [""] + timing_fields(r.timing, [
            ("plain greedy", f"{r.plain_tokens_per_second:.1f} tok/s" if r.plain_tokens_per_second is not None else None),
            ("speedup", f"{r.speedup:.2f} x" if r.speedup is not None else None),
        ])
    return out


@_layout(R.TraceResult)
def _trace(r: R.TraceResult, timing: bool) -> list[str]:
    if r.expert_layers is not None:
        return _trace_experts(r)
    out = [f"trace: {r.slice}, {r.model_layers}-layer model"]
    if r.intervention is not None:
        out.append(f"with {intervention(r.intervention)}")
    rows = []
    for x in r.rows:
        ran = _layers_with_operators(x.layers, x.operators)
        rows.append([str(x.position), str(x.token_id), fmt_text(x.token), ran, str(x.next_id), fmt_text(x.next_token)])
    return out + table([num("pos"), num("id"), "token", "layers run", num("next id"), "next token"], rows)


def _trace_experts(r: R.TraceResult) -> list[str]:
    """TRACE ... EXPERTS: per position, each shown layer's experts with their weights
    ('expert:weight', in the router's order), the bytes the step read, and the next token."""
    shown = r.expert_layers or []
    out = [f"trace: {r.slice}, {r.model_layers}-layer model; experts of "
           + "; ".join(f"layer {x.layer} (top {x.top_k} of {x.experts}, {x.router})" for x in shown)]
    rows = []
    for x in r.rows:
        picks = {p.layer: p for p in x.experts or []}
        cells = [" ".join(f"{e}:{w:.3f}" for e, w in zip(picks[s.layer].experts, picks[s.layer].weights))
                 if s.layer in picks else "-" for s in shown]
        rows.append([str(x.position), str(x.token_id), fmt_text(x.token), *cells, fmt_int(x.bytes_read),
                     str(x.next_id), fmt_text(x.next_token)])
    headers = [num("pos"), num("id"), "token", *[f"layer {s.layer} experts" for s in shown], num("bytes read"),
               num("next id"), "next token"]
    return out + table(headers, rows)


def _layers_with_operators(layers: Sequence[int], operators: Sequence[str]) -> str:
    """Runs of consecutive layers with one operator: '0-3 softmax (full)', '0-2 mamba2, 3 softmax (full)'."""
    runs: list[list] = []
    for i, op in zip(layers, operators):
        if runs and runs[-1][2] == op and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i, op])
    return ", ".join((f"{a}-{b}" if a != b else f"{a}") + f" {op}" for a, b, op in runs) or "none"


@_layout(R.DraftResult)
def _draft(r: R.DraftResult, timing: bool) -> list[str]:
    if r.depth is None:
        return [f"draft off: later statements run the full model ({r.model_layers} layers)"]
    c = r.reads
    return [
        (f"draft depth {r.depth}: later INFER, TRACE, EXPLAIN and DUMP LOGITS run "
        f"{layers_phrase(r.executed_layers)} of {r.model_layers}"),
    ] + fields([("reads", f"{c.total_reads} operands, {fmt_bytes(c.total_bytes)}")])


@_layout(R.VerifyResult)
def _verify(r: R.VerifyResult, timing: bool) -> list[str]:
    where = f" in {r.path}" if r.show_path else ""
    if r.ok:
        return [f"verified {r.checked} files{where}: every hash matches the index"]
    return ([f"VERIFY FAILED{where}: {len(r.problems)} problem(s) in {r.checked} files checked"]
            + [f"  - {p}" for p in r.problems])


@_layout(R.PlanResult)
def _plan(r: R.PlanResult, timing: bool) -> list[str]:
    out = fields([
        ("checkpoint", r.source + (f" ({r.source_kind})" if r.source_kind else "")),
        ("model type", r.model_type or "-"),
        ("family", r.family),
        ("admissible", "yes" if r.admissible else "no: " + f"{sum(f.blocks for f in r.findings)} finding(s) block it"),
        ("layers", None if r.layers is None else f"{r.layers} ({fmt_mix(r.operator_mix or [])})"),
        ("tensors", None if r.tensors is None else f"{r.tensors} ({fmt_int(r.parameters)} parameters)"),
    ])
    if r.findings:
        headers = ["category", "key", "value", "blocks", "message"]
        out += [""] + table(headers, [
            [f.category, f.key, short(fmt_value(f.value))]
            + ["BLOCKS" if f.blocks else "", f.message] for f in r.findings
        ])
    return out


@_layout(R.EncodeResult)
def _encode(r: R.EncodeResult, timing: bool) -> list[str]:
    out = [f"encoded {r.source} into {r.path}"] + fields([
        ("model", r.name),
        ("layers", f"{r.layers} ({fmt_mix(r.operator_mix)})"),
        ("weights", fmt_bytes(r.bytes)),
    ])
    if timing and r.seconds is not None:
        out += fields([("encode time", fmt_seconds(r.seconds))])
    return out


# ---- representations and maintenance -----------------------------------------------------


@_layout(R.RepresentResult)
def _represent(r: R.RepresentResult, timing: bool) -> list[str]:
    ratio = f" ({100 * r.bytes / r.source_bytes:.1f}% of {fmt_int(r.source_bytes)})" if r.source_bytes else ""
    out = [f"represented {r.source} as {r.encoding} into {r.path}"] + fields([
        ("weights", f"{fmt_int(r.bytes)} bytes{ratio}"),
        ("exact", "yes: every tensor holds its source's values" if r.exact else "no (fidelity per tensor in provenance)"),
    ] + ([("time", fmt_seconds(r.seconds))] if timing and r.seconds is not None else []))
    out += [""] + shares(r.encodings)
    if r.kept:
        groups: dict[tuple[str, str], list[str]] = {}
        for k in r.kept:
            groups.setdefault((k.encoding, k.reason), []).append(k.tensor)
        out += ["", f"not {r.encoding} ({len(r.kept)} tensors):"]
        for (enc, why), names in groups.items():
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            out.append(f"  {enc}: {names[0]}{more}: {why}")
    if r.worst:
        out += ["", "largest relative RMS error:"] + table(
            ["tensor", "encoding", num("rel rms"), num("max abs"), num("bits/weight")],
            [[w["tensor"], w["encoding"], f"{w['rel_rms_error']:.2e}", f"{w['max_abs_error']:.2e}",
              fmt_bpw(w["bits_per_weight"])] for w in r.worst])
    if r.not_carried:
        out += ["", "not carried (derived from the source's weights): " + ", ".join(r.not_carried)]
    return out


@_layout(R.CompactResult)
def _compact(r: R.CompactResult, timing: bool) -> list[str]:
    out = [f"compacted {r.source} into {r.path} (generation {r.generation})"] + fields([
        ("copied", f"{r.copied} files, {fmt_bytes(r.copied_bytes)}, byte for byte"),
        ("left behind", f"{len(r.left_behind)} entries, {fmt_bytes(sum(f.bytes for f in r.left_behind))}"
         if r.left_behind else "nothing (every file is referenced by the index)"),
    ])
    if r.left_behind:
        out += table(["path", "kind", num("bytes")], [[f.path, f.kind, fmt_int(f.bytes)] for f in r.left_behind])
    return out


@_layout(R.DiffResult)
def _diff(r: R.DiffResult, timing: bool) -> list[str]:
    out = fields([("a", r.a), ("b", r.b), ("verdict", r.verdict)] + ([("relation", r.relation)] if r.relation else []))
    if r.differences:
        out += [""] + table(["kind", "area", "what", "a", "b"],
                            [[d.kind, d.area, d.what, _diff_cell(d.a), _diff_cell(d.b)] for d in r.differences])
    return out


def _diff_cell(v: Any) -> str:
    return fmt_int(v) if isinstance(v, int) and not isinstance(v, bool) else fmt_value(v)


@_layout(R.RepresentationScoreResult)
def _score_rep(r: R.RepresentationScoreResult, timing: bool) -> list[str]:
    out = [f"{r.candidate} against {r.reference} on {r.bank}: {r.prompts} prompts, {r.positions} positions"] + fields([
        ("KL p50 / p95", f"{r.kl_p50:.3g} / {r.kl_p95:.3g} nats"),
        ("KL mean / max", f"{r.kl_mean:.3g} / {r.kl_max:.3g} nats"),
        ("top-1 agreement", f"{r.top1:.4f}"),
        (f"greedy-{r.greedy} agreement", (f"{r.greedy_agreement:.4f} (all {r.greedy} tokens on "
                                          f"{round(r.greedy_exact * r.prompts)} of {r.prompts} prompts)")),
        ("stored", f"in {r.candidate}'s provenance (evidence)" if r.stored else "no"),
    ] + ([("time", fmt_seconds(r.seconds))] if timing and r.seconds is not None else []))
    out += [""] + table(["prompt", "category", num("positions"), num("KL mean"), num("top-1"), num(f"greedy-{r.greedy}")],
                        [[p["id"], p["category"], fmt_int(p["positions"]), f"{p['kl_mean']:.3g}", f"{p['top1']:.3f}",
                          f"{p['greedy_agreement']:.3f}"] for p in r.per_prompt])
    return out


@_layout(R.DumpResult)
def _dump(r: R.DumpResult, timing: bool) -> list[str]:
    slice_ = "full model" if r.depth is None else f"draft depth {r.depth}"
    out = [f"dumped {r.positions} x {r.vocab:,} float32 logits ({slice_}) to {r.path}"]
    out += fields([
        ("sidecar", r.sidecar),
        ("layers run", fmt_layers(r.executed_layers)),
        ("container", str(r.meta.get("container_digest", "-"))[:16]),
        ("ablated", intervention(r.meta.get("intervention"))),
    ])
    if timing:
        out += fields([
            ("prepare", fmt_seconds(r.meta.get("prepare_seconds"))),
            ("per position", f"{r.meta['ms_per_position']:.2f} ms" if r.meta.get("ms_per_position") is not None else None),
        ])
    return out


@_layout(R.ScoreResult)
def _score(r: R.ScoreResult, timing: bool) -> list[str]:
    slice_ = f"full model, {r.model_layers} layers" if r.depth is None else f"depth {r.depth} of {r.model_layers}"
    out = [f"draft {r.draft} ({slice_}) against {r.target} (full model)"]
    if r.draft_intervention is not None or r.target_intervention is not None:
        # an ablated run against a clean one (or two ablations) is a different comparison: say so
        out += fields([("draft run", intervention(r.draft_intervention) or "clean (no intervention)"),
                       ("target run", intervention(r.target_intervention) or "clean (no intervention)")])
    out += fields(summary_fields(r.summary))
    if r.positions:
        if r.tokens:
            out += [""] + table(
                [num("pos"), num("KL"), "top-1", num("target argmax"), "target token", num("draft argmax"), "draft token", num("rank in draft")],
                [[str(p["position"]), f"{p['kl']:.4f}", "yes" if p.get("top1") else "no", str(p["target_argmax"]),
                  fmt_text(p.get("target_token")), str(p["draft_argmax"]), fmt_text(p.get("draft_token")),
                  str(p["target_rank_in_draft"])] for p in r.positions],
            )
        else:
            out += [""] + table(
                [num("pos"), num("KL"), "top-1", num("target argmax"), num("draft argmax"), num("rank in draft")],
                [[str(p["position"]), f"{p['kl']:.4f}", "yes" if p.get("top1") else "no", str(p["target_argmax"]),
                  str(p["draft_argmax"]), str(p["target_rank_in_draft"])] for p in r.positions],
            )
    return out


@_layout(R.LadderResult)
def _ladder(r: R.LadderResult, timing: bool) -> list[str]:
    headers = [num(h) for h in ("depth", "positions", "top-1", "KL p50", "KL p90", "KL p99", "rank p50", "top-5",
                                "top-20")]
    if timing:
        headers += [num("prepare"), num("ms/position")]
    rows = []
    for row in r.rows:
        s = row["summary"]
        cells = [str(row["depth"]), str(s["positions"]), f"{s['top1']:.3f}", f"{s['kl_p50']:.4f}",
                 f"{s['kl_p90']:.4f}", f"{s['kl_p99']:.4f}", f"{s['median_target_rank']:g}",
                 f"{s['top5']:.3f}", f"{s['top20']:.3f}"]
        if timing:
            cells += [fmt_seconds(row.get("prepare_seconds")), f"{row['ms_per_position']:.2f} ms"]
        rows.append(cells)
    if r.interrupted:
        done = ", ".join(str(d) for d in r.depths) or "none"
        out = [f"depth ladder on {r.prompts_file}: interrupted; depths finished: {done}"]
    else:
        out = [f"depth ladder on {r.prompts_file}: {r.report.get('prompts', '?')} prompts, {r.model_layers}-layer model"]
    if rows:
        out += table(headers, rows)
    if timing and r.target:
        out.append(f"full model: {fmt_seconds(r.target.get('prepare_seconds'))} prepare, "
                   f"{r.target.get('ms_per_position', 0.0):.2f} ms per position")
    if r.into:
        out.append(f"report written to {r.into}")
    if r.plot_path:
        out.append(f"chart written to {r.plot_path}")
    return out


# ---- entry points ---------------------------------------------------------------------


@_layout(R.ModelsResult)
def _models(r: R.ModelsResult, timing: bool) -> list[str]:
    if not r.models:
        return [f"no containers in {r.directory} (a container is a directory holding an index.json)"]
    out = [f"{len(r.models)} container(s) in {r.directory}:"]
    out += table(["path", "name", num("layers"), num("generation"), num("bytes"), "problem"],
                 [[m.path, m.name or "-", "-" if m.layers is None else str(m.layers),
                   "-" if m.generation is None else str(m.generation), fmt_bytes(m.bytes), m.problem or ""]
                  for m in r.models])
    return out


@_layout(R.NoteResult)
def _note(r: R.NoteResult, timing: bool) -> list[str]:
    return list(r.lines)


@_layout(R.CompileResult)
def _compile(r: R.CompileResult, timing: bool) -> list[str]:
    out = [f"compiled {r.source} into {r.path}: no patch overlay in this build, so a verified copy"]
    out += fields([
        ("files", f"{r.files} copied ({fmt_bytes(r.bytes)}), each checked against its recorded hash"),
        ("verified", f"{r.verified} checked in the written container"),
        ("generation", str(r.generation)),
        ("left behind", f"{r.left_behind} file(s) the index does not refer to" if r.left_behind else None),
        ("on conflict", f"{r.on_conflict} (no patches, so no conflicts)" if r.on_conflict else None),
    ])
    return out


def to_text(result: R.Result, *, timing: bool = True, width: int | None = None, expanded: str = "off") -> str:
    """The result as aligned text (no trailing newline). ``width``: fit tables to it (cells
    cut with an ellipsis, never wrapped); ``expanded``: on, off or auto (one field per line
    when a table does not fit)."""
    layout = _LAYOUTS.get(type(result))
    with fitting(width, expanded):
        lines = layout(result, timing) if layout is not None else result.layout(timing)
        lines += [f"note: {n}" for n in getattr(result, "notes", None) or []]
        return "\n".join(lines)


def to_json(result: R.Result) -> dict:
    """One object per statement: ``{"statement", "kind", "ok", "result"}``; keys are stable
    (declaration order), values JSON-safe."""
    body = result.model_dump(mode="json", exclude={"statement", "kind"})
    return {
        "statement": result.statement.model_dump() if result.statement else None,
        "kind": result.kind,
        "ok": True,
        "result": body,
    }


def error_json(err: BaseException, statement: R.StatementRef | None) -> dict:
    """The JSON object for a statement that failed. One shape for every failure:
    ``{"statement", "kind", "ok": false, "error": {type, message, hint, line, column,
    expected}}``; ``expected`` lists what a syntax error expected (empty otherwise)."""
    from .errors import LqlError

    if isinstance(err, LqlError):
        error = {"type": err.kind, "message": err.message, "hint": err.hint, "line": err.line,
                 "column": err.column, "expected": list(getattr(err, "expected", []) or [])}
    else:
        from .errors import describe_exception

        error = {"type": "InternalError", "message": f"internal error: {describe_exception(err)}", "hint": None,
                 "line": statement.line if statement else None, "column": statement.column if statement else None,
                 "expected": []}
    return {
        "statement": statement.model_dump() if statement else None,
        "kind": statement.kind if statement else None,
        "ok": False,
        "error": error,
    }


# ---- errors as text: the one formatter ------------------------------------------------


def error_fragments(err: BaseException, *, where: str = "", show_statement: bool = False) -> list[tuple[str, str]]:
    """An error as styled fragments (style class, text): a syntax error with its line and a
    caret, a refusal with its message, the statement (with ``where`` or ``show_statement``)
    and its hint. ``where`` (a file name, ``<-e>``) prefixes ``where:line:column:``."""
    from .errors import LqlError, LqlSyntaxError, caret_window

    if isinstance(err, LqlSyntaxError):
        head = (f"{where}:{err.line}:{err.column}: syntax error: " if where
                else f"syntax error at line {err.line}, column {err.column}: ")
        shown, col = caret_window(err.source_line, err.column)
        pad = "".join("\t" if ch == "\t" else " " for ch in shown[: col - 1])
        frags = [("class:error", f"{head}{err.message}\n"), ("", f"  {shown}\n"),
                 ("class:error.caret", f"  {pad}^")]
        if err.hint:
            frags.append(("class:warning", f"\n  hint: {err.hint}"))
        return frags
    if isinstance(err, LqlError):
        loc = (f"{where}:{err.line}:{err.column}: " if where and err.line is not None
               else (f"{where}: " if where else ""))
        frags = [("class:error", f"{loc}error: {err.message}")]
        if err.statement and (show_statement or where):
            frags.append(("", f"\n  in: {clip_statement(err.statement)}"))
        if err.hint:
            frags.append(("class:warning", f"\n  hint: {err.hint}"))
        return frags
    from .errors import describe_exception

    return [("class:error", f"internal error: {describe_exception(err)}")]


def clip_statement(text: str, limit: int = 300) -> str:
    """A statement's text as an error shows it: at most ``limit`` characters."""
    return text if len(text) <= limit else text[: limit - 40] + " … " + text[-30:]


def error_text(err: BaseException, *, where: str = "", show_statement: bool = False) -> str:
    """`error_fragments` as plain text."""
    return "".join(t for _, t in error_fragments(err, where=where, show_statement=show_statement))


def internal_error_text(err: BaseException, *, where: str = "", line: int | None = None, column: int | None = None,
                        statement: str | None = None, debug: bool = False) -> str:
    """A bug's one-line report (the traceback is shown separately, with --debug)."""
    from .errors import describe_exception

    loc = f"{where}:{line}:{column}: " if where and line is not None else (f"{where}: " if where else "")
    out = f"{loc}internal error: {describe_exception(err)}"
    if statement:
        out += f"\n  in: {clip_statement(statement)}"
    if not debug:
        out += "\n  this is a bug in lql or vindex3; run with --debug for the traceback"
    return out


# ---- rows: CSV, TSV, Markdown, JSON lines, pandas, HTML -------------------------------

_RECORDS: dict[type, Callable[[Any], list[dict[str, Any]]]] = {}


def _records_of(cls: type):
    def deco(fn):
        _RECORDS[cls] = fn
        return fn

    return deco


_flat, _dump = R.flat, R.dump


def records(result: R.Result) -> list[dict[str, Any]]:
    """The result's rows as flat dicts: one per layer for SHOW LAYERS, one per candidate for
    INFER ... TOP, one per generated token for GENERATE alone, one per position for TRACE and
    SCORE DRAFT, one per depth for DRAFT LADDER, one per operand for SHOW OPERANDS and
    EXPLAIN, one per finding for PLAN; a single row of fields otherwise."""
    fn = _RECORDS.get(type(result))
    return fn(result) if fn is not None else result.records()


@_records_of(R.DiffResult)
def _rec_diff(r: R.DiffResult) -> list[dict[str, Any]]:
    return [_dump(x) for x in r.differences]


@_records_of(R.RepresentationScoreResult)
def _rec_score_rep(r: R.RepresentationScoreResult) -> list[dict[str, Any]]:
    return [dict(p) for p in r.per_prompt]


@_records_of(R.CompactResult)
def _rec_compact(r: R.CompactResult) -> list[dict[str, Any]]:
    return [_dump(x) for x in r.left_behind]


@_records_of(R.ExplainResult)
def _rec_explain(r: R.ExplainResult) -> list[dict[str, Any]]:
    out = []
    for st in r.steps:
        for op in st.ops:
            for o in op.operands or [None]:
                out.append({"stage": st.stage, "layer": st.layer, "operator": st.operator, "op": op.kind,
                            "op_role": op.role, "operand": o.role if o else None,
                            "tensor": f"{o.object}/{o.tensor}" if o else None, "dtype": o.dtype if o else None,
                            "shape": o.shape if o else None, "bytes": o.bytes if o else None})
    return out


@_records_of(R.InferResult)
def _rec_infer(r: R.InferResult) -> list[dict[str, Any]]:
    if r.top is not None:
        return [_dump(c) for c in r.top]
    return [{"position": i, "id": t} for i, t in enumerate(r.generated_ids or [])]


@_records_of(R.TraceResult)
def _rec_trace(r: R.TraceResult) -> list[dict[str, Any]]:
    return [_dump(x) for x in r.rows]


@_records_of(R.ScoreResult)
def _rec_score(r: R.ScoreResult) -> list[dict[str, Any]]:
    return [dict(p) for p in r.positions]


@_records_of(R.LadderResult)
def _rec_ladder(r: R.LadderResult) -> list[dict[str, Any]]:
    out = []
    for row in r.rows:
        rec = {"depth": row["depth"], **{k: v for k, v in row["summary"].items()}}
        rec.update({k: row[k] for k in ("executed_layers", "prepare_seconds", "ms_per_position") if k in row})
        out.append(rec)
    return out


@_records_of(R.PlanResult)
def _rec_plan(r: R.PlanResult) -> list[dict[str, Any]]:
    return [_dump(f) for f in r.findings]


@_records_of(R.VerifyResult)
def _rec_verify(r: R.VerifyResult) -> list[dict[str, Any]]:
    if r.ok:
        return [{"path": r.path, "ok": True, "checked": r.checked, "problem": None}]
    return [{"path": r.path, "ok": False, "checked": r.checked, "problem": p} for p in r.problems]


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    cols: dict[str, None] = {}
    for row in rows:
        for k in row:
            cols.setdefault(k, None)
    return list(cols)


def _cell(v: Any) -> str:
    """A value as one CSV/TSV/Markdown cell: lists and objects as JSON, None as empty."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, dict)):
        return dumps_json(v)
    return str(v)


def to_delimited(result: R.Result, delimiter: str = ",") -> str:
    """CSV (or TSV with a tab) of `records`: a header line, then one line per row."""
    rows = records(result)
    if not rows:
        return ""
    cols = _columns(rows)
    buf = io.StringIO()
    if delimiter == "\t":  # TSV: no quoting; tabs and newlines inside a value are escaped
        esc = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r", "\\": "\\\\"})
        buf.write("\t".join(cols) + "\n")
        for row in rows:
            buf.write("\t".join(_cell(row.get(c)).translate(esc) for c in cols) + "\n")
    else:
        w = csv.writer(buf, delimiter=delimiter, lineterminator="\n")
        w.writerow(cols)
        for row in rows:
            w.writerow([_cell(row.get(c)) for c in cols])
    return buf.getvalue().rstrip("\n")


def to_markdown(result: R.Result) -> str:
    """A GitHub-flavoured Markdown table of `records` (pipes escaped, newlines as <br>)."""
    rows = records(result)
    if not rows:
        return ""
    cols = _columns(rows)

    def cell(v: Any) -> str:
        return _cell(v).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(cell(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(out)


def to_jsonl(result: R.Result) -> str:
    """One compact JSON object per row of `records`."""
    return "\n".join(dumps_json(row) for row in records(result))


def format_result(result: R.Result, fmt: str, *, timing: bool = True, width: int | None = None,
                  expanded: str = "off", indent: int | None = None) -> str:
    """The result in one of `FORMATS` (no trailing newline)."""
    if fmt == "json":
        return dumps_json(to_json(result), indent=indent)
    if fmt == "jsonl":
        return to_jsonl(result)
    if fmt == "csv":
        return to_delimited(result, ",")
    if fmt == "tsv":
        return to_delimited(result, "\t")
    if fmt == "markdown":
        return to_markdown(result)
    return to_text(result, timing=timing, width=width, expanded=expanded)


def to_pandas(result: R.Result):
    """`records` as a pandas DataFrame (pandas is an optional extra)."""
    from .errors import NotAvailable

    try:
        import pandas as pd
    except ImportError:
        raise NotAvailable("to_pandas() needs pandas, which is not installed",
                           hint="pip install 'lql-vindex3[notebook]' (or pandas)") from None
    return pd.DataFrame.from_records(records(result), columns=_columns(records(result)) or None)


def to_html(result: R.Result) -> str:
    """An HTML view for notebooks: the rows as a table (a single row as field/value pairs),
    the statement as a caption, and the text layout in a collapsible block."""
    rows = records(result)
    esc = html.escape
    caption = esc(result.statement.text) if result.statement else esc(result.kind)
    parts = ['<div class="lql-result">', f"<table><caption><code>{caption}</code></caption>"]
    if len(rows) == 1:
        parts.append("<tr><th>field</th><th>value</th></tr>")
        parts += [f"<tr><td>{esc(k)}</td><td>{esc(_cell(v))}</td></tr>" for k, v in rows[0].items()]
    elif rows:
        cols = _columns(rows)
        parts.append("<tr>" + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{esc(_cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows]
    parts.append("</table>")
    parts.append(f"<details><summary>text</summary><pre>{esc(to_text(result))}</pre></details></div>")
    return "\n".join(parts)


# ---- the ladder chart ------------------------------------------------------------------

CHART_FORMATS = (".png", ".svg")


def require_matplotlib(what: str) -> None:
    """Refuse by name when matplotlib (an optional extra) is missing."""
    from .errors import NotAvailable

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise NotAvailable(f"{what} needs matplotlib, which is not installed",
                           hint="pip install 'lql-vindex3[notebook]' (or matplotlib)") from None


def ladder_figure(result: R.LadderResult):
    """A matplotlib Figure of a ladder: KL p50 and p90 (left axis, nats) and top-1 agreement
    (right axis) against draft depth."""
    require_matplotlib("plotting a ladder")
    from matplotlib.figure import Figure

    depths = [row["depth"] for row in result.rows]
    s = [row["summary"] for row in result.rows]
    fig = Figure(figsize=(7.0, 4.0), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(depths, [x["kl_p50"] for x in s], marker="o", label="KL p50")
    ax.plot(depths, [x["kl_p90"] for x in s], marker="o", linestyle="--", label="KL p90")
    ax.set_xlabel(f"draft depth (layers of {result.model_layers})")
    ax.set_ylabel("KL(target ‖ draft), nats")
    ax2 = ax.twinx()
    ax2.plot(depths, [x["top1"] for x in s], marker="s", color="tab:green", label="top-1 agreement")
    ax2.set_ylim(0.0, 1.05)
    ax2.set_ylabel("top-1 agreement")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper center")
    ax.set_title(f"depth ladder on {result.prompts_file}")
    return fig


def save_figure(fig, path: str) -> None:
    """Write a figure as PNG or SVG, chosen by the file's extension."""
    from pathlib import Path

    from .errors import StatementError

    ext = Path(path).suffix.lower()
    if ext not in CHART_FORMATS:
        raise StatementError(f"PLOT INTO writes .png or .svg, not {Path(path).name!r}",
                             hint="e.g. PLOT INTO 'ladder.png'")
    fig.savefig(path, format=ext[1:])


# ---- vindex3's own reports, laid out here ----------------------------------------------


def admission_text(plan) -> str:
    """A vindex3 AdmissionPlan as text (the ``vindex3 plan`` command prints this)."""
    from .commands.container import plan_result

    return to_text(plan_result(plan))


def verify_text(report) -> str:
    """A vindex3 VerifyReport as text (the ``vindex3 verify`` command prints this)."""
    from .commands.container import verify_result

    return to_text(verify_result(report, show_path=True))


def ladder_text(report, *, timing: bool = True) -> str:
    """A vindex3 LadderReport as DRAFT LADDER prints it."""
    from .commands.drafts import ladder_result

    return to_text(ladder_result(report, prompts_file=report.prompts_file, into=None), timing=timing)


def dumps_json(obj: Any, *, indent: int | None = None) -> str:
    """Strict JSON text for one statement's object (non-finite floats in the project's tagged
    spelling, see vindex3.jsonio)."""
    from vindex3 import jsonio

    return escape_surrogates(jsonio.dumps(obj, indent=indent))


_SURROGATE = re.compile("[\ud800-\udfff]")


def escape_surrogates(text: str) -> str:
    """``text`` with every lone surrogate (text that no encoding can write: a file name read with
    surrogateescape, a character no string literal may hold) written as ``\\udXXX``, so that
    printing it cannot fail. In JSON text the escape is JSON's own (surrogates only occur inside
    strings there), and a reader gets the same code point back."""
    if _SURROGATE.search(text) is None:
        return text
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text)
