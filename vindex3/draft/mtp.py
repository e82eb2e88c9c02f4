"""Multi-token-prediction (MTP) heads as drafter components: DeepSeek-V3's ``model.layers.{L + j}``
modules, admitted by the family into the graph as a ``drafter`` component (object ``mtp``,
component ``mtp``) wired to the primary text model by a hidden-state edge, and run here.

The formulation (DeepSeek-V3 technical report, section 2.2; the order of the concatenation and
the hidden it reads are those of the released weights' serving code)::

    x_i  = eh_proj( concat( RMSNorm_e(embed(t_{i+1})), RMSNorm_h(h_i) ) )     [hidden]
    g_i  = decoder_block(x_i)           (MLA + dense or routed FFN, its own latent KV cache)
    logits_i = head( RMSNorm_shared_head(g_i) )          predicts t_{i+2}

``h_i`` is the main model's hidden at position i *after its final norm* (the edge's ``site``:
``final_norm``), ``embed``/``head`` are the main model's unless the module stores its own copy
(``embed_tokens`` / ``shared_head.head``), and the block runs at rope position i. Chaining (what
DeepSeek-V3's speculative use does with its one module): the k-th proposal feeds the block's own
output ``g`` in place of ``h`` with the embedding of the (k-1)-th proposal, at the next position.

The block is executed by the ordinary executor: a one-layer graph is built from the stored
layer entry, the main model's core surface and the module's own operator facts, and its tensors
are read from the ``mtp`` object through a renaming tensor source (no executor code knows MTP).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import ComponentError, StateError, VindexError

F32 = np.float32
KIND = "mtp"
OWN_ROLES = {"enorm": "h", "hnorm": "h", "eh_proj": "eh", "head_norm": "h", "head": "vh", "embedding": "vh"}
REQUIRED = ("enorm", "hnorm", "eh_proj", "head_norm")
DRAFTER_KEYS = {"kind", "edge", "formulation", "norm_eps", "norm_weight_offset", "chain", "surface", "modules"}


# ---- the graph side ---------------------------------------------------------------------------


def drafter_objects(graph: Any) -> dict[str, dict]:
    """object name -> its drafter entry, for every object a drafter component owns."""
    return {o: e["drafter"] for o, e in graph.objects.items() if isinstance(e, dict) and isinstance(e.get("drafter"), dict)}


def mtp_entry(container: Any) -> tuple[str, dict]:
    """(object, drafter entry) of the container's MTP drafter, or a named refusal."""
    g = container.graph
    found = [(o, d) for o, d in drafter_objects(g).items() if d.get("kind") == KIND]
    if not found:
        comps = ", ".join(f"{c.name} ({c.role})" for c in g.components) or "none"
        raise ComponentError(f"{container.path.name} has no multi-token-prediction (MTP) drafter component "
                             f"(components: {comps})",
                             hint="MTP heads come with checkpoints that store them (DeepSeek-V3's "
                                  "num_nextn_predict_layers modules); other drafters: DEPTH d, LOOKUP")
    if len(found) > 1:
        raise ComponentError(f"{container.path.name} has {len(found)} MTP drafter components "
                             f"({', '.join(o for o, _ in found)}); exactly one is read")
    return found[0]


def block_graph(graph: Any, obj: str, module: dict) -> tuple[dict, dict[str, str]]:
    """The one-layer graph of an MTP module's decoder block (raw dict) and the map from its
    objects to the container's: decoder_stack and final_norm are the ``obj`` object, embedding
    and output head the module's own copies or the main model's."""
    from ..graph import CORE_SURFACE

    d = graph.objects[obj]["drafter"]
    own = module.get("operands") or {}
    surface = {k: v for k, v in graph.surface.items() if k in CORE_SURFACE and k != "operators"}
    for k, v in (d.get("surface") or {}).items():
        surface[k] = v
    surface.setdefault("operators", {})
    objmap = {"decoder_stack": obj, "final_norm": obj}
    if "embedding" in own:
        emb = own["embedding"]
        objmap["embedding"] = obj
    else:
        emb = graph.objects["embedding"]["operands"]["weight"]
        objmap["embedding"] = "embedding"
    objects = {"embedding": {"kind": "embedding", "operands": {"weight": emb}},
               "decoder_stack": {"kind": "decoder_stack", "layers": 1},
               "final_norm": {"kind": "final_norm", "operands": {"weight": own.get("head_norm", "")}}}
    head = dict(surface["head"])
    if "head" in own:
        objects["output_head"] = {"kind": "output_head", "operands": {"weight": own["head"]}}
        objmap["output_head"] = obj
        head["tied"] = False
    elif graph.core.head.tied and "embedding" in own:  # the main head is the main embedding
        objects["output_head"] = {"kind": "output_head", "operands": {"weight": graph.objects["embedding"]["operands"]["weight"]}}
        objmap["output_head"] = "embedding"
        head["tied"] = False
    elif not graph.core.head.tied:
        objects["output_head"] = {"kind": "output_head", "operands": dict(graph.objects["output_head"]["operands"])}
        objmap["output_head"] = "output_head"
    surface["head"] = head
    raw = {"schema": graph.raw["schema"], "model": dict(graph.model),
           "components": [{"name": "mtp_block", "role": "primary_text", "objects": list(objects)}],
           "objects": objects, "layers": [dict(module["block"], index=0)], "surface": surface}
    return raw, objmap


def drafter_closure(graph: Any, obj: str, tables: dict) -> list[str]:
    """Closure of a drafter component's object: every module's own operands by role and shape,
    its decoder block by the block's operators (the ordinary closure over its one-layer graph),
    and no tensor of the object that no module claims. Unknown keys of the entry are defects."""
    from .. import closure
    from ..graph import Graph

    d = graph.objects[obj]["drafter"]
    where = f"drafter {obj}"
    if d.get("kind") != KIND:
        return [f"{where}: drafter kind {d.get('kind')!r} has no reader in this build (known: {KIND})"]
    extra = sorted(set(d) - DRAFTER_KEYS)
    if extra:
        return [f"{where}: unknown key {extra[0]!r} in its drafter entry (known: {', '.join(sorted(DRAFTER_KEYS))})"]
    table = tables.get(obj)
    if table is None:
        return [f"{where}: object {obj} has no segment"]
    H, V = graph.hidden_size, graph.vocab_size
    shapes = {"h": (H,), "eh": (H, 2 * H), "vh": (V, H)}
    defects: list[str] = []
    claimed: set[str] = set()
    for m in d.get("modules") or []:
        j = m.get("module")
        own = m.get("operands") or {}
        for role in REQUIRED:
            if role not in own:
                defects.append(f"{where} module {j}: missing operand role {role}")
        for role, name in sorted(own.items()):
            if role not in OWN_ROLES:
                defects.append(f"{where} module {j}: role {role} is not an operand of an MTP module "
                               f"(known: {', '.join(OWN_ROLES)})")
                continue
            if name not in table:
                defects.append(f"{where} module {j} {role}: missing operand {obj}/{name}")
                continue
            claimed.add(name)
            got = tuple(table[name][1])
            if got != shapes[OWN_ROLES[role]]:
                defects.append(f"{where} module {j} {role}: {obj}/{name} has shape {list(got)}, the surface implies "
                               f"{list(shapes[OWN_ROLES[role]])}")
        try:
            raw, objmap = block_graph(graph, obj, m)
            bg = Graph(raw)
        except (VindexError, KeyError, TypeError) as e:
            defects.append(f"{where} module {j}: its decoder block does not form a graph: {e}")
            continue
        prefix = f"{j}."
        block_names = {n for n in table if n.startswith(prefix)} - set(own.values())
        sub: dict[str, dict] = {"decoder_stack": {n: table[n] for n in block_names}, "final_norm": {}}
        if own.get("head_norm") in table:
            sub["final_norm"] = {own["head_norm"]: table[own["head_norm"]]}
        for syn in ("embedding", "output_head"):
            real = objmap.get(syn)
            if real == obj:  # the module's own copy
                name = own["embedding" if syn == "embedding" else "head"]
                sub[syn] = {name: table[name]} if name in table else {}
            elif real is not None:
                sub[syn] = tables.get(real, {})
        for x in closure.check(bg, sub):
            if x.startswith(("embedding/", "output_head/")):  # the main model's ends: judged by the main closure
                continue
            defects.append(f"{where} module {j} block: {x}")
        claimed |= block_names
    for name in sorted(set(table) - claimed):
        defects.append(f"{obj}/{name}: unclassified tensor (no MTP module claims it)")
    return defects


def drafter_uses(graph: Any, tables: dict) -> dict:
    """label -> `OperandUse` of every tensor a drafter component's object holds, as its executor
    reads it (what `vindex3.opplan.operand_uses` says of the main plan's tensors): the module's
    eh_proj and own head / embedding are matrices, its norms arrays, its block's tensors as the
    block's operators read them. Encode (native, --keep-dtype) and REPRESENT ask this so that a
    drafter's matrices keep or take the encodings the decoder's do."""
    from ..graph import Graph
    from ..opplan import OperandUse, build_op_plan, operand_uses

    out: dict = {}
    for obj, d in drafter_objects(graph).items():
        if d.get("kind") != KIND or obj not in tables:
            continue
        table = tables[obj]
        for m in d.get("modules") or []:
            own = m.get("operands") or {}
            for role, name in own.items():
                kind = "matrix" if OWN_ROLES.get(role) in ("eh", "vh") else "array"
                out[f"{obj}/{name}"] = OperandUse(kind, (f"mtp_{role}",))
            try:
                raw, objmap = block_graph(graph, obj, m)
                plan = build_op_plan(Graph(raw), {syn: tables[real] for syn, real in objmap.items()})
            except (VindexError, KeyError, TypeError):
                continue  # the closure names what is wrong with it
            for label, use in operand_uses(plan).items():
                syn, _, name = label.partition("/")
                if objmap.get(syn) == obj and name in table and f"{obj}/{name}" not in out:
                    out[f"{obj}/{name}"] = use
    return out


# ---- execution --------------------------------------------------------------------------------


class _Renamed:
    """A tensor source that reads a one-layer graph's objects from the container's."""

    def __init__(self, inner: Any, objmap: dict[str, str]):
        self.inner, self.objmap = inner, objmap

    def weight(self, ref):
        return self.inner.weight(replace(ref, object=self.objmap.get(ref.object, ref.object)))

    def representation_key(self, obj: str) -> str:
        return self.inner.representation_key(self.objmap.get(obj, obj))


class MtpHead:
    """One MTP module of a container, prepared: ``inputs(tokens, h)`` builds the block's input rows,
    ``start()`` a stream of the block (hidden in, hidden out, its own latent KV cache), ``logits(g)``
    reads a block output through the shared-head norm and the head, ``normed(h)`` is the main
    model's final norm (what the edge reads)."""

    def __init__(self, container: Any, module: int = 0, max_positions: int | None = None, main: Any = None):
        from ..exec.engine import Executor
        from ..exec.ops.norm import make_weight
        from ..exec.slice import Full, LayerRange
        from ..graph import Graph
        from ..opplan import OperandRef, build_op_plan
        from .slices import open_container

        c = open_container(container)
        self.container = c
        self.object, d = mtp_entry(c)
        mods = d.get("modules") or []
        if not 0 <= module < len(mods):
            raise ComponentError(f"the MTP drafter has {len(mods)} module(s); module {module} does not exist")
        m = mods[module]
        self.module = module
        self.entry = d
        raw, objmap = block_graph(c.graph, self.object, m)
        plan = build_op_plan(Graph(raw), {syn: c.segments[real].entries for syn, real in objmap.items()})
        src = _Renamed(c.tensor_source(), objmap)
        t0 = time.perf_counter()
        self.ends = Executor(plan, src, Full(), max_positions=max_positions)
        self.block = Executor(plan, src, LayerRange(0, 1), max_positions=max_positions)
        # the main model's final norm (the edge's site): the verifying executor's, when given
        self.main = main if main is not None else c.executor(Full(), max_positions=max_positions)
        W = self.ends.prepared
        entries = c.segments[self.object].entries
        own = m["operands"]

        def ref(role: str):
            e = entries[own[role]]
            return OperandRef(self.object, own[role], e.dtype, tuple(e.shape), e.nbytes)

        off = float(d["norm_weight_offset"])
        self.eps = F32(d["norm_eps"])
        self.enorm = make_weight(W.array(ref("enorm")), off)
        self.hnorm = make_weight(W.array(ref("hnorm")), off)
        self.eh = W.weight(ref("eh_proj"))
        self.prepare_seconds = time.perf_counter() - t0
        self.geometry = self.block.plan.layers[0].geometry

    @property
    def name(self) -> str:
        return f"mtp module {self.module}"

    def normed(self, h: np.ndarray) -> np.ndarray:
        """The main model's hidden after its final norm (the edge's site)."""
        return self.main.readout.normed(h)

    def inputs(self, tokens: Sequence[int], h: np.ndarray) -> np.ndarray:
        """eh_proj([RMSNorm_e(embed(tokens)); RMSNorm_h(h)]) -> [T, hidden] float32."""
        from ..exec.ops.norm import rms_norm

        e = self.ends.embed(list(tokens))
        x = np.concatenate([rms_norm(e, self.enorm, self.eps), rms_norm(np.asarray(h, F32), self.hnorm, self.eps)],
                           axis=1)
        return self.eh.mm(x)

    def start(self):
        return self.block.start()

    def logits(self, g: np.ndarray) -> np.ndarray:
        return self.ends.readout(g)

    def forward(self, main_hidden: np.ndarray, next_tokens: Sequence[int]) -> np.ndarray:
        """Batch: logits [T, vocab] of rows (h_i, t_{i+1}), i = 0..T-1, in a fresh block stream;
        ``main_hidden`` is the main model's residual leaving its last layer (not yet normed)."""
        if len(next_tokens) != np.shape(main_hidden)[0]:
            raise VindexError(f"an MTP row pairs a hidden row with the next token: {np.shape(main_hidden)[0]} rows, "
                              f"{len(next_tokens)} tokens")
        st = self.start()
        return self.logits(st.prefill_hidden(self.inputs(next_tokens, self.normed(main_hidden))))


class MtpDrafter:
    """An MTP module as a `vindex3.generate.Drafter`. It reads the main model's hidden rows off
    the verifying stream (``full``) after every call, keeps one block row per position the main
    model has consumed, and proposes by chaining the module on its own output (``chain``;
    without it, one token a round). Rows of chained proposals are cut off before the next round."""

    name = "mtp"

    def __init__(self, head: MtpHead, full: Any, lookahead: int, chain: bool = True):
        if head.geometry.rollback != "truncate":
            raise StateError(f"the MTP block's state cannot be cut back ({head.geometry.describe()}); "
                             "drafting with it needs rows that truncate")
        self.head, self.full = head, full
        self.lookahead = lookahead if chain else 1
        self.st = head.start()
        self.ctx: list[int] = []
        self.hid: list[np.ndarray] = []  # the main model's normed hidden rows, one per consumed position
        self.true_rows = 0  # block rows built from real main hidden rows
        self.steps = 0  # block calls
        self._first = True

    def _take_rows(self, n: int) -> None:
        rows = self.full.last_hidden
        if rows is None or rows.shape[0] < n:
            raise StateError(f"the verifying stream holds no hidden rows for the {n} position(s) it consumed")
        self.hid.extend(self.head.normed(np.asarray(rows[:n], F32)))
        if len(self.hid) != self.full.position:
            raise StateError(f"the MTP drafter holds {len(self.hid)} hidden rows; the main stream is at "
                             f"position {self.full.position}")

    def begin(self, prompt: Sequence[int]) -> None:
        self.ctx = [int(t) for t in prompt]
        self._take_rows(len(self.ctx))

    def accept(self, tokens: Sequence[int]) -> None:
        if self._first:  # the first pick: the prompt's rows are taken already
            self._first = False
        else:  # the previous pending token and the accepted drafts were consumed
            self._take_rows(len(tokens))
        self.ctx.extend(int(t) for t in tokens)

    def propose(self, limit: int) -> list[int]:
        k = min(self.lookahead, limit)
        if k <= 0:
            return []
        n = len(self.hid)  # rows 0..n-1 pair h_i with t_{i+1}; t_n is the pending token
        if self.st.position > self.true_rows:
            self.st.truncate(self.true_rows)
        g = self.st.prefill_hidden(self.head.inputs(self.ctx[self.true_rows + 1:n + 1],
                                                    np.stack(self.hid[self.true_rows:n])))[-1:]
        self.true_rows = n
        self.steps += 1
        props: list[int] = []
        while True:
            tok = int(np.argmax(self.head.logits(g)[0]))
            props.append(tok)
            if len(props) == k:
                return props
            g = self.st.step_hidden(self.head.inputs([tok], g))  # chained: the block's own output as h
            self.steps += 1


def mtp_generate(container: Any, token_ids: Sequence[int], n: int, lookahead: int = 1,
                 on_token: Callable[[int], None] | None = None, *, chain: bool = True, module: int = 0,
                 compare_plain: bool = False, max_positions: int | None = None):
    """Greedy generation of ``n`` tokens with the container's MTP module proposing up to
    ``lookahead`` tokens a round (chained on its own output), verified by the full model: the
    tokens are the full model's greedy continuation. Returns a `SpecResult` (drafter "mtp")."""
    from .slices import make_executor, open_container, resolve_slice
    from .speculative import (
        SpecResult,
        _check_counts,
        _check_prompt,
        _compared,
        _drafted,
        _rollback_mode,
        _Tally,
    )

    c = open_container(container)
    prompt = _check_prompt(token_ids)
    _check_counts(n, lookahead)
    full_slice, _ = resolve_slice(c, None)
    full_ex, prep = make_executor(c, full_slice, max_positions=max_positions)
    head = MtpHead(c, module, max_positions=max_positions, main=full_ex)
    if n > 0:
        full_ex.check_positions(len(prompt) + n - 1, f"SPECULATE ({len(prompt)} prompt tokens, {n} generated)")
    out: list[int] = []
    stats = _Tally(lookahead, n)
    mode = "truncate"
    steps = 0
    t0 = time.perf_counter()
    if n > 0:
        fst = full_ex.start()
        mode = _rollback_mode(c, full_slice, fst, "full")
        drafter = MtpDrafter(head, fst, lookahead, chain)
        out = _drafted(fst, prompt, n, drafter, mode, stats, on_token)
        steps = drafter.steps
    secs = time.perf_counter() - t0
    result = SpecResult(tokens=out, prompt_tokens=len(prompt), n=n, depth=None, lookahead=lookahead, drafter="mtp",
                        rollback=mode, **stats.facts(len(out)), draft_steps=steps,
                        prepare_seconds=prep + head.prepare_seconds, seconds=secs, prefill_seconds=stats.prefill_seconds,
                        tokens_per_second=len(out) / secs if secs > 0 else 0.0)
    return _compared(result, compare_plain, c, prompt, n, full_ex, secs)
