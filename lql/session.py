"""The session: holds the bound container, the default draft depth and the settings; parses
text, plans each statement, executes the plan against vindex3 and returns typed results.

Every refusal leaves as an `LqlError` positioned at its statement; vindex3's refusals pass
through with their own message (`EngineRefusal`). Anything else is a bug and propagates as is
(front ends show it as an internal error, with a traceback only when asked)."""

from __future__ import annotations

import importlib
import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import ast, catalog
from . import results as R
from .errors import (
    EngineRefusal,
    FileRefusal,
    LqlError,
    NotAvailable,
    SettingError,
    StatementError,
)
from .parser import parse
from .planner import Context, QueryPlan, plan

TokenHook = Callable[[int, str | None], None]  # (token id, its text or None) as GENERATE emits it
ProgressHook = Callable[[int, int, str], None]  # (done, total, label) for ENCODE, DRAFT LADDER


@dataclass
class Outcome:
    """One statement's outcome when a script runs: a result, or the error that stopped it."""

    statement: ast.Statement
    result: R.Result | None = None
    error: LqlError | None = None


def _vindex3():
    import vindex3

    return vindex3


def _engine_refusal(err: Exception) -> EngineRefusal:
    hint = getattr(err, "hint", None)
    message = str(err)
    suffix = f"\n  hint: {hint}"
    if hint and message.endswith(suffix):
        message = message[: -len(suffix)]
    return EngineRefusal(message, engine_kind=type(err).__name__, hint=hint)


def _draft_module(what: str):
    """vindex3.draft, or a refusal naming the statement that needs it."""
    try:
        draft = importlib.import_module("vindex3.draft")
    except ImportError as e:
        raise NotAvailable(f"{what} is not available in this build (vindex3.draft cannot be imported: {e})") from None
    return draft


class Session:
    """An LQL session. ``Session()`` starts unbound; ``Session(path)`` opens a container.

    ``on_token(id, text)`` is called for each token GENERATE produces, as it is produced;
    ``on_progress(done, total, label)`` during ENCODE, OPEN DEFAULT and DRAFT LADDER."""

    def __init__(self, path: str | Path | None = None, *, on_token: TokenHook | None = None,
                 on_progress: ProgressHook | None = None):
        self.container = None
        self.default_model = False
        self.draft_depth: int | None = None
        self.settings: dict[str, Any] = {s.name: s.default for s in catalog.SETTINGS}
        self.on_token = on_token
        self.on_progress = on_progress
        self._executors: dict[int | None, Any] = {}
        if path is not None:
            self.execute_statement(ast.Open(path=str(path), source=f"OPEN {str(path)!r}"))

    # ---- public API -------------------------------------------------------------------

    def execute(self, text: str) -> list[R.Result]:
        """Run every statement of ``text``; return their results. The first failure raises
        (`LqlSyntaxError` before anything runs, or an `LqlError` naming the statement); the
        results of the statements that ran before it are on the error as ``err.results``."""
        done: list[R.Result] = []
        for out in self.run(text):
            if out.error is not None:
                out.error.results = done
                raise out.error
            done.append(out.result)
        return done

    def run(self, text: str, *, keep_going: bool = False) -> Iterator[Outcome]:
        """Parse all of ``text`` (a syntax error raises before anything runs), then execute
        statement by statement, yielding each outcome as it completes. Stops after the first
        failure unless ``keep_going``."""
        statements = parse(text)
        for stmt in statements:
            try:
                result = self.execute_statement(stmt)
            except LqlError as e:
                yield Outcome(stmt, error=e)
                if not keep_going:
                    return
            else:
                yield Outcome(stmt, result=result)

    def run_file(self, path: str | Path) -> list[R.Result]:
        """Run a script file; like `execute`."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise FileRefusal(f"script {p} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise FileRefusal(f"script {p} cannot be read: {e}") from None
        return self.execute(text)

    def execute_statement(self, stmt: ast.Statement) -> R.Result:
        """Plan and execute one parsed statement."""
        try:
            qp = plan(stmt, self._context())
            result = getattr(self, f"_do_{qp.op}")(qp)
        except LqlError as e:
            raise e.locate(stmt.line, stmt.column, stmt.source) from None
        except Exception as e:
            vindex3 = _vindex3()
            if isinstance(e, vindex3.errors.VindexError):
                raise _engine_refusal(e).locate(stmt.line, stmt.column, stmt.source) from e
            raise
        result.statement = R.StatementRef(kind=stmt.kind, line=stmt.line, column=stmt.column, text=stmt.source)
        return result

    @property
    def bound(self) -> bool:
        return self.container is not None

    def close(self) -> None:
        """Forget the bound container and every prepared executor."""
        self.container = None
        self._executors.clear()
        self.draft_depth = None

    # ---- helpers ----------------------------------------------------------------------

    def _context(self) -> Context:
        return Context(bound=self.bound, draft_depth=self.draft_depth, top=self.settings["top"])

    def _slice(self, depth: int | None):
        v = _vindex3()
        return v.Full() if depth is None else v.Draft(depth)

    def _executor(self, depth: int | None) -> tuple[Any, bool]:
        """The executor for a depth (prepared once per session), and whether it was prepared now."""
        ex = self._executors.get(depth)
        if ex is not None:
            return ex, False
        ex = self.container.executor(slice=self._slice(depth))
        self._executors[depth] = ex
        return ex, True

    def _slice_label(self, depth: int | None) -> str:
        return "full model" if depth is None else f"draft depth {depth}"

    def _prompt(self, prompt: ast.TextPrompt | ast.TokenPrompt) -> R.PromptInfo:
        c = self.container
        if isinstance(prompt, ast.TextPrompt):
            ids = [int(i) for i in c.tokenizer.encode(prompt.text)]
            if not ids:
                raise StatementError(f"the prompt {prompt.text!r} tokenises to no tokens")
            text = prompt.text
        else:
            ids, text = list(prompt.ids), None
            if not ids:
                raise StatementError("TOKENS () holds no token ids")
        vocab = c.op_plan().vocab
        bad = [i for i in ids if i >= vocab]
        if bad:
            raise StatementError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return R.PromptInfo(text=text, ids=ids)

    def _token_text(self, token_id: int) -> str | None:
        return self.container.tokenizer.token_text(token_id) if self.container.has_tokenizer else None

    def _decode(self, ids: list[int]) -> str | None:
        return self.container.tokenizer.decode(ids) if self.container.has_tokenizer else None

    def _mix(self) -> list[R.MixEntry]:
        return [R.MixEntry(label=label, count=n) for label, n in self.container.graph.operator_mix()]

    def _reads(self, sp) -> R.ReadCost:
        return R.ReadCost(ends_reads=sp.ends_reads, ends_bytes=sp.ends_bytes, layer_reads=sp.layer_reads,
                          layer_bytes=sp.layer_bytes, total_reads=sp.total_reads, total_bytes=sp.total_bytes)

    def _num_layers(self) -> int:
        return self.container.graph.num_layers

    def _check_layer(self, qp: QueryPlan, layer: int, what: str) -> None:
        n = self._num_layers()
        if not 0 <= layer < n:
            raise StatementError(f"{what} {layer} does not exist: the model has {n} layers (0..{n - 1})")

    # ---- binding ----------------------------------------------------------------------

    def _do_open(self, qp: QueryPlan) -> R.OpenResult:
        v = _vindex3()
        if qp.args["default"]:
            try:
                default_model = importlib.import_module("vindex3.default_model")
            except ImportError as e:
                raise NotAvailable(f"OPEN DEFAULT is not available in this build (vindex3.default_model "
                                   f"cannot be imported: {e})") from None
            ensure = default_model.ensure
            if "progress" in inspect.signature(ensure).parameters:
                path = ensure(progress=self.on_progress)
            else:
                path = ensure()
        else:
            path = qp.args["path"]
        c = v.open(path)
        cleared = self.draft_depth
        # One assignment, so an interrupt cannot leave old executors bound to the new container.
        self.container, self.default_model, self._executors, self.draft_depth = c, bool(qp.args["default"]), {}, None
        comp = c.graph.component
        return R.OpenResult(
            name=c.name, path=str(c.path), default_model=self.default_model, component=comp.name, role=comp.role,
            layers=c.graph.num_layers, operator_mix=self._mix(), tokenizer=c.has_tokenizer,
            generation=c.generation, draft_reset=cleared,
        )

    # ---- facts ------------------------------------------------------------------------

    def _do_stats(self, qp: QueryPlan) -> R.StatsResult:
        c = self.container
        comp = c.graph.component
        op_plan = c.op_plan()
        objects = [R.ObjectRow(object=o["object"], representation=o.get("representation", "-"),
                               tensors=o.get("tensors", 0), parameters=o["parameters"], bytes=o["bytes"])
                   for o in c.objects()]
        geoms = c.continuation()
        positions = qp.args["positions"]
        return R.StatsResult(
            name=c.name, path=str(c.path), generation=c.generation, digest=c.digest, component=comp.name,
            role=comp.role, layers=c.graph.num_layers, operator_mix=self._mix(), objects=objects,
            parameters=sum(o.parameters for o in objects), bytes=sum(o.bytes for o in objects),
            vocab=op_plan.vocab, head_tied=bool(op_plan.head.params.get("tied")), tokenizer=c.has_tokenizer,
            continuation=_continuation_summary(geoms), positions=positions,
            state_bytes_at_positions=None if positions is None else sum(g.bytes_at(positions) for g in geoms),
        )

    def _do_explain(self, qp: QueryPlan) -> R.ExplainResult:
        c = self.container
        sp = c.plan_slice(self._slice(qp.depth))
        op_plan = c.op_plan()
        steps = [R.ExplainStep(stage="embedding", ops=[_op_info(op_plan.embedding)])]
        for i in sp.executed_layers:
            lo = op_plan.layers[i]
            g = lo.geometry
            steps.append(R.ExplainStep(
                stage="layer", layer=lo.index, operator=c.graph.layers[i].label(), params=dict(lo.params),
                geometry=g.describe(), bytes_per_position=g.bytes_per_position, fixed_bytes=g.fixed_bytes,
                ops=[_op_info(op) for op in lo.ops],
            ))
        steps.append(R.ExplainStep(stage="final_norm", ops=[_op_info(op_plan.final_norm)]))
        steps.append(R.ExplainStep(stage="head", ops=[_op_info(op_plan.head)]))
        prompt = state = None
        if qp.args["prompt"] is not None:
            prompt = self._prompt(qp.args["prompt"])
            state = sum(op_plan.layers[i].geometry.bytes_at(len(prompt.ids)) for i in sp.executed_layers)
        executed = list(sp.executed_layers)
        return R.ExplainResult(
            slice=self._slice_label(qp.depth), depth=qp.depth, model_layers=c.graph.num_layers,
            executed_layers=executed, skipped_layers=[i for i in range(c.graph.num_layers) if i not in executed],
            prompt=prompt, state_bytes_after_prompt=state, steps=steps, reads=self._reads(sp),
        )

    def _do_show_layers(self, qp: QueryPlan) -> R.LayersResult:
        c = self.container
        start, end = qp.args["start"], qp.args["end"]
        n = c.graph.num_layers
        if start is not None:
            self._check_layer(qp, start, "layer")
            self._check_layer(qp, end, "layer")
        idx = range(n) if start is None else range(start, end + 1)
        geoms = c.continuation()
        rows = []
        for i in idx:
            lp, g = c.graph.layers[i], geoms[i]
            pos = lp.position
            pos_text = None
            if pos is not None:
                pos_text = pos.get("kind")
                if pos_text == "rope" and pos.get("theta") is not None:
                    pos_text = f"rope theta={pos['theta']:g}"
            rows.append(R.LayerRow(
                layer=lp.index, operator=lp.operator, span=lp.span, window=lp.window, position=pos_text,
                ffn=getattr(lp, "ffn", None), continuation=g.describe(), bytes_per_position=g.bytes_per_position,
                fixed_bytes=g.fixed_bytes,
            ))
        return R.LayersResult(model_layers=n, layers=rows)

    def _do_show_components(self, qp: QueryPlan) -> R.ComponentsResult:
        g = self.container.graph
        comps = getattr(g, "components", None) or [g.component]
        return R.ComponentsResult(components=[
            R.ComponentRow(name=x.name, role=x.role, objects=list(getattr(x, "objects", ()) or ()),
                           executes=x.role == "primary_text")
            for x in comps
        ])

    def _do_show_representations(self, qp: QueryPlan) -> R.RepresentationsResult:
        import fnmatch

        flt = qp.args["filter"]
        rows = []
        for r in self.container.representations:
            key = r["key"]
            if flt is not None:
                pat = flt.lower()
                hay = f"{key} {r.get('object', '')} {r.get('segment', '')}".lower()
                if any(ch in pat for ch in "*?["):
                    if not (fnmatch.fnmatch(key.lower(), pat) or fnmatch.fnmatch(r.get("object", "").lower(), pat)):
                        continue
                elif pat not in hay:
                    continue
            rows.append(R.RepresentationRow(
                key=key, object=r.get("object", "-"), encoding=r.get("encoding"), segment=r.get("segment", "-"),
                tensors=r.get("tensors"), payload_bytes=r.get("payload_bytes"),
                payload_sha256=r.get("payload_sha256"), segment_sha256=r.get("segment_sha256"),
            ))
        return R.RepresentationsResult(filter=flt, representations=rows)

    def _do_show_provenance(self, qp: QueryPlan) -> R.ProvenanceResult:
        return R.ProvenanceResult(provenance=dict(self.container.provenance))

    def _do_show_operands(self, qp: QueryPlan) -> R.OperandsResult:
        c = self.container
        op_plan = c.op_plan()
        layer = qp.args["layer"]
        rows: list[R.OperandRow] = []

        def add(stage: str, idx: int | None, op) -> None:
            for role, ref in op.operands.items():
                rows.append(R.OperandRow(stage=stage, layer=idx, op=op.kind, op_role=getattr(op, "role", "") or "", role=role, object=ref.object,
                                         tensor=ref.tensor, dtype=ref.dtype, shape=list(ref.shape), bytes=ref.nbytes))

        if layer is not None:
            self._check_layer(qp, layer, "layer")
            for op in op_plan.layers[layer].ops:
                add("layer", layer, op)
        else:
            add("embedding", None, op_plan.embedding)
            for lo in op_plan.layers:
                for op in lo.ops:
                    add("layer", lo.index, op)
            add("final_norm", None, op_plan.final_norm)
            add("head", None, op_plan.head)
        # a tied head reads the embedding again: a second read, not new bytes
        distinct = {f"{r.object}/{r.tensor}": r.bytes for r in rows}
        return R.OperandsResult(layer=layer, operands=rows, total_bytes=sum(distinct.values()))

    def _do_show_settings(self, qp: QueryPlan) -> R.SettingsResult:
        return R.SettingsResult(settings=[
            R.SettingRow(name=s.name, value=_setting_text(self.settings[s.name]), description=s.description)
            for s in catalog.SETTINGS
        ])

    # ---- running ----------------------------------------------------------------------

    def _do_infer(self, qp: QueryPlan) -> R.InferResult:
        c = self.container
        c.plan_slice(self._slice(qp.depth))  # refuse a bad depth before tokenising anything
        prompt = self._prompt(qp.args["prompt"])
        ex, fresh = self._executor(qp.depth)
        top_n, gen_n = qp.args["top"], qp.args["generate"]
        st = ex.start()
        t0 = time.perf_counter()
        last = np.asarray(st.prefill(prompt.ids)[-1])
        prefill_s = time.perf_counter() - t0
        executed = [int(i) for i in ex.trace.executed_layers]
        top = None
        if top_n is not None:
            top = _top_candidates(last, top_n, self._token_text)
        gen_ids = gen_text = None
        timing = R.Timing(prepare_seconds=ex.trace.prepare_seconds if fresh else None, prefill_seconds=prefill_s)
        if gen_n is not None:
            gen_ids = []
            t1 = time.perf_counter()
            logits = last
            for k in range(gen_n):
                tok = int(np.argmax(logits))
                gen_ids.append(tok)
                if self.on_token is not None:
                    self.on_token(tok, self._token_text(tok))
                if k + 1 < gen_n:
                    logits = np.asarray(st.step(tok))
            decode_s = time.perf_counter() - t1
            gen_text = self._decode(gen_ids)
            timing.decode_seconds = decode_s
            timing.ms_per_token = decode_s * 1000.0 / gen_n
            timing.tokens_per_second = gen_n / decode_s if decode_s > 0 else None
        return R.InferResult(slice=self._slice_label(qp.depth), depth=qp.depth, executed_layers=executed,
                             prompt=prompt, top=top, generated_ids=gen_ids, generated_text=gen_text, timing=timing)

    def _do_speculate(self, qp: QueryPlan) -> R.SpeculateResult:
        draft = _draft_module("INFER ... SPECULATE")
        c = self.container
        prompt = self._prompt(qp.args["prompt"])
        kwargs: dict[str, Any] = {}
        params = inspect.signature(draft.speculative_generate).parameters
        if "compare_plain" in params:
            kwargs["compare_plain"] = bool(self.settings["compare"])
        on_token = None
        if self.on_token is not None:
            hook = self.on_token

            def on_token(tok: int) -> None:
                hook(int(tok), self._token_text(int(tok)))

        res = draft.speculative_generate(c, prompt.ids, qp.args["generate"], qp.depth, qp.args["lookahead"],
                                         on_token=on_token, **kwargs)
        plain = getattr(res, "plain", None)
        return R.SpeculateResult(
            prompt=prompt, depth=res.depth, lookahead=res.lookahead, generated_ids=list(res.tokens),
            generated_text=self._decode(list(res.tokens)), rounds=res.rounds, proposed=res.proposed,
            accepted=res.accepted, acceptance_rate=res.acceptance_rate, tokens_per_full_step=res.tokens_per_full_step,
            full_model_calls=res.full_model_calls, rollback=res.rollback, matches_plain=getattr(res, "matches_plain", None),
            timing=R.Timing(prepare_seconds=res.prepare_seconds, decode_seconds=res.seconds,
                            tokens_per_second=res.tokens_per_second),
            speedup=getattr(res, "speedup", None),
            plain_tokens_per_second=plain.tokens_per_second if plain is not None else None,
        )

    def _do_trace(self, qp: QueryPlan) -> R.TraceResult:
        c = self.container
        c.plan_slice(self._slice(qp.depth))
        prompt = self._prompt(qp.args["prompt"])
        ex, _ = self._executor(qp.depth)
        labels = [lp.label() for lp in c.graph.layers]
        st = ex.start()
        rows = []
        for pos, tok in enumerate(prompt.ids):
            logits = np.asarray(st.step(tok))  # one position at a time: the trace of that position
            ran = [int(i) for i in ex.trace.executed_layers]
            nxt = int(np.argmax(logits))
            rows.append(R.TraceRow(position=pos, token_id=tok, token=self._token_text(tok), layers=ran,
                                   operators=[labels[i] for i in ran], next_id=nxt, next_token=self._token_text(nxt)))
        return R.TraceResult(slice=self._slice_label(qp.depth), depth=qp.depth, model_layers=c.graph.num_layers,
                             prompt=prompt, rows=rows)

    def _do_draft(self, qp: QueryPlan) -> R.DraftResult:
        sp = self.container.plan_slice(self._slice(qp.depth))  # refuses depth 0 and deeper than the model
        self.draft_depth = qp.depth
        return R.DraftResult(depth=qp.depth, model_layers=self._num_layers(), executed_layers=list(sp.executed_layers),
                             reads=self._reads(sp))

    def _do_draft_off(self, qp: QueryPlan) -> R.DraftResult:
        self.draft_depth = None
        if not self.bound:
            return R.DraftResult(depth=None, model_layers=0, executed_layers=[],
                                 reads=R.ReadCost(ends_reads=0, ends_bytes=0, layer_reads=0, layer_bytes=0,
                                                  total_reads=0, total_bytes=0))
        sp = self.container.plan_slice(self._slice(None))
        return R.DraftResult(depth=None, model_layers=self._num_layers(), executed_layers=list(sp.executed_layers),
                             reads=self._reads(sp))

    # ---- drafts made measurable -------------------------------------------------------

    def _do_dump(self, qp: QueryPlan) -> R.DumpResult:
        draft = _draft_module("DUMP LOGITS")
        c = self.container
        c.plan_slice(self._slice(qp.depth))
        prompt = self._prompt(qp.args["prompt"])
        path = Path(qp.args["into"])
        if not path.parent.exists():
            raise FileRefusal(f"cannot write {path}: its directory {path.parent} does not exist")
        try:
            meta = draft.dump_logits(c, prompt.ids, self._slice(qp.depth), path)
        except OSError as e:
            raise FileRefusal(f"cannot write {path}: {e.strerror or e}") from None
        sidecar = draft.sidecar_path(path) if hasattr(draft, "sidecar_path") else Path(f"{path}.meta.json")
        return R.DumpResult(path=str(path), sidecar=str(sidecar), depth=meta.get("draft_depth"),
                            positions=int(meta["positions"]), vocab=int(meta["vocab"]),
                            executed_layers=list(meta.get("executed_layers", [])), meta=meta)

    def _do_score(self, qp: QueryPlan) -> R.ScoreResult:
        draft = _draft_module("SCORE DRAFT")
        for key in ("draft", "target"):
            if not Path(qp.args[key]).exists():
                raise FileRefusal(f"SCORE DRAFT: the {key} dump {qp.args[key]} does not exist")
        rep = draft.score_files(qp.args["draft"], qp.args["target"])
        return R.ScoreResult(
            draft=qp.args["draft"], target=qp.args["target"], depth=rep.draft_depth, model_layers=rep.model_layers,
            summary=rep.summary.model_dump(mode="json"), positions=[p.model_dump(mode="json") for p in rep.positions],
        )

    def _do_ladder(self, qp: QueryPlan) -> R.LadderResult:
        draft = _draft_module("DRAFT LADDER")
        prompts = Path(qp.args["prompts"])
        if not prompts.exists():
            raise FileRefusal(f"DRAFT LADDER: the prompt bank {prompts} does not exist")
        into = qp.args["into"]
        if into is not None and not Path(into).parent.exists():
            raise FileRefusal(f"cannot write {into}: its directory {Path(into).parent} does not exist")
        rep = draft.run_ladder(self.container, qp.args["depths"], prompts, out_path=into, progress=self.on_progress)
        full = rep.model_dump(mode="json")
        rows = full.pop("rows")
        return R.LadderResult(prompts_file=str(prompts), into=into, model_layers=rep.model_layers,
                              depths=list(rep.depths), rows=rows, target=full.get("target", {}), report=full)

    # ---- the container, checkpoints, the session --------------------------------------

    def _do_verify(self, qp: QueryPlan) -> R.VerifyResult:
        rep = self.container.verify()
        return R.VerifyResult(path=str(getattr(rep, "path", self.container.path)), ok=rep.ok, checked=rep.checked,
                              problems=list(rep.problems))

    def _do_admit(self, qp: QueryPlan) -> R.PlanResult:
        v = _vindex3()
        p = v.admit(qp.args["path"])
        return R.PlanResult(
            source=str(p.source), model_type=p.model_type, admissible=p.admissible,
            findings=[R.FindingRow(category=f.category, key=f.key, value=_jsonable(f.value), grade=getattr(f, "grade", "") or "",
                                   message=f.message, blocks=f.blocks) for f in p.findings],
        )

    def _do_encode(self, qp: QueryPlan) -> R.EncodeResult:
        v = _vindex3()
        t0 = time.perf_counter()
        out = v.encode(qp.args["checkpoint"], qp.args["into"], progress=self.on_progress)
        secs = time.perf_counter() - t0
        c = v.open(out)
        return R.EncodeResult(
            source=qp.args["checkpoint"], path=str(out), name=c.name, layers=c.graph.num_layers,
            operator_mix=[R.MixEntry(label=label, count=n) for label, n in c.graph.operator_mix()],
            bytes=sum(o["bytes"] for o in c.objects()), timing=R.Timing(decode_seconds=None, prepare_seconds=secs),
        )

    def _do_help(self, qp: QueryPlan) -> R.HelpResult:
        topic = qp.args["topic"]
        text = catalog.help_text(topic)
        if text is None:
            close = catalog.closest_topics(topic)
            raise StatementError(
                f"HELP has no entry for {topic!r}",
                hint=(f"did you mean {' or '.join(close)}? " if close else "") + "HELP alone lists every statement",
            )
        return R.HelpResult(topic=topic, text=text)

    def _do_set(self, qp: QueryPlan) -> R.SetResult:
        name, raw = qp.args["name"], qp.args["value"]
        doc = catalog.setting(name)
        if doc is None:
            raise SettingError(f"there is no setting named {name!r}",
                               hint="settings: " + ", ".join(s.name for s in catalog.SETTINGS))
        try:
            value = doc.parse(raw)
        except ValueError as e:
            raise SettingError(f"setting {name} {e}; got {raw!r}") from None
        previous = self.settings[name]
        self.settings[name] = value
        return R.SetResult(name=name, value=_setting_text(value), previous=_setting_text(previous))


# ---- pure helpers ---------------------------------------------------------------------


def _setting_text(v: Any) -> Any:
    if isinstance(v, bool):
        return "on" if v else "off"
    return v


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return repr(v)


def _op_info(op) -> R.OpInfo:
    return R.OpInfo(
        kind=op.kind, role=getattr(op, "role", "") or "", params=_jsonable(dict(op.params)),
        operands=[R.Operand(role=role, object=ref.object, tensor=ref.tensor, dtype=ref.dtype, shape=list(ref.shape),
                            bytes=ref.nbytes) for role, ref in op.operands.items()],
    )


def _continuation_summary(geoms: list) -> R.ContinuationSummary:
    """Per kind of state part: the layers that keep one and their bytes (rows per position, or
    fixed), summed over the parts; nothing here asks which operator a layer runs."""
    from vindex3.continuation import KV, LATENT, RECURRENT

    def rows(kind: str) -> int:
        return sum(p.row_bytes for g in geoms for p in g.of(kind))

    return R.ContinuationSummary(
        layers=len(geoms), kv_layers=sum(g.has(KV) for g in geoms), kv_bytes_per_position=rows(KV),
        windowed_kv_layers=sum(any(p.window for p in g.of(KV)) for g in geoms),
        latent_layers=sum(g.has(LATENT) for g in geoms), latent_bytes_per_position=rows(LATENT),
        recurrent_layers=sum(g.has(RECURRENT) for g in geoms),
        recurrent_bytes=sum(p.fixed_bytes for g in geoms for p in g.of(RECURRENT)),
        stateless_layers=sum(g.stateless for g in geoms),
    )


def _top_candidates(logits: np.ndarray, n: int, token_text: Callable[[int], str | None]) -> list[R.Candidate]:
    x = logits.astype(np.float64)
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    n = min(n, p.shape[0])
    # stable order: probability descending, then id ascending, so ties never depend on the sort
    order = np.lexsort((np.arange(p.shape[0]), -p))[:n]
    return [R.Candidate(rank=k + 1, token=token_text(int(i)), id=int(i), probability=float(p[i]))
            for k, i in enumerate(order)]
