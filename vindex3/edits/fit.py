"""Fitting edits: COMPOSE, MEMIT and KNN, each over a model (a container or an `EditedModel`).

Every mode starts from the same probe: the prompt run once, keeping per layer the FFN's input
and the residual leaving the layer at the last position. The weight modes then need a residual
change that makes the target likely: `residual_target` searches it at a layer's output by
normalised gradient steps on log P(target), the gradient taken exactly through the final norm
and head and carried back unchanged (a first-order guess), each step checked by a real forward
pass with the residual patched. Corpus statistics (mean FFN input, mean residual, the FFN key
covariance) come from the frozen prompt bank plus text the model generates from it, unless the
caller names another corpus; what was used travels in each edit's ``fit`` record."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import QueryRefused
from .overlay import Edit, EditedModel, KnnKey, Patch, TensorWrite, enc

F32 = np.float32


@dataclass
class FitSettings:
    """How edits are fitted (every value is recorded with the edit)."""

    threshold: float = 0.75  # KNN: cosine above which a key fires (the reference's value)
    floor: float = 0.30  # COMPOSE: the target's probability is rescaled into [floor, ceiling]
    ceiling: float = 0.95
    goal: float = 0.95  # MEMIT: the probability the residual target reaches at the last edit layer
    lam: float = 15000.0  # MEMIT: weight of the key covariance against the new keys
    ridge: float = 1e-2  # MEMIT: covariance + ridge * mean(diag) * I (a corpus has fewer rows than keys)
    corpus: str | None = None  # a JSONL prompt bank; None: the frozen prompt bank
    generate: int = 8  # tokens the model generates from each corpus prompt, also used as keys
    max_iters: int = 24
    # MEMIT's keys and values: "subject" reads them at the subject's last token (ROME / MEMIT; the
    # edit must name its entity, found in the prompt's tokenization); "last-token" at the prompt's
    # last token, with the first-order residual target (this build's earlier MEMIT)
    key: str = "subject"
    contexts: int = 5  # prefixes the key is averaged over (besides none): text generated from ROME's seed words
    context_tokens: int = 5  # tokens generated for each prefix
    v_steps: int = 25  # Adam steps on the value delta (at most; stops early once the target's NLL < v_stop)
    v_lr: float = 0.5  # Adam's learning rate
    v_clamp: float = 4.0  # |delta| <= v_clamp * |h| (h: the residual it is added to)
    v_kl: float = 0.0625  # weight of KL(unedited || edited) at '{subject} is a' (ROME's essence drift)
    v_decay: float = 0.5  # weight of |delta|^2 / |h|^2
    v_stop: float = 0.05  # the mean NLL of the target under which the value fit stops
    max_gflop: float = 4000.0  # bound on a value fit's arithmetic, checked before it starts
    # MEMIT's covariance weight with subject keys: they are typical of the corpus (a subject's last
    # token is an ordinary word), so the last-token weight (lam) would keep almost all of each layer's
    # share from being written (on SmolLM2: efficacy 0 at 15000, 1 at 1500 on the two edits tried)
    lam_subject: float = 1500.0
    # MEMIT's preservation keys: a JSONL of {prompt, subject} lines (held-out subjects of the edited
    # relations, never the prompts an edit is scored on) whose subject keys the closed form keeps in
    # place, weighted by preserve_weight each (`memit_solve`'s Kp); None: no preservation
    preserve: str | None = None
    preserve_weight: float = 30.0  # chosen on the held-out tuning set (docs/editing.md)

    def record(self) -> dict:
        return {k: getattr(self, k) for k in ("threshold", "floor", "ceiling", "goal", "lam", "ridge", "generate")}

    def value_record(self) -> dict:
        """MEMIT's key and value-fit settings (in a subject-keyed MEMIT edit's fit record)."""
        return {k: getattr(self, k) for k in ("key", "contexts", "context_tokens", "v_steps", "v_lr", "v_clamp", "v_kl",
                                              "v_decay", "v_stop", "max_gflop", "lam_subject")}


@dataclass
class Request:
    """One fact to write: token ids of the prompt, the target's first token, and (when known) the
    unedited model's top-1 token there."""

    prompt: str
    target: str
    ids: list[int]
    target_id: int
    original_id: int | None = None
    entity: str | None = None
    relation: str | None = None
    extra: dict = field(default_factory=dict)


def request(model, prompt: str, target: str, entity: str | None = None, relation: str | None = None) -> Request:
    tok = model.tokenizer
    ids = tok.encode(prompt)
    t = tok.encode(target, special=False)
    if not ids:
        raise QueryRefused(f"prompt {prompt!r} tokenizes to nothing")
    if not t:
        raise QueryRefused(f"target {target!r} tokenizes to nothing")
    return Request(prompt, target, list(ids), int(t[0]), entity=entity, relation=relation)


# ---- parts of the model --------------------------------------------------------------------------


def base_and_patches(model):
    if isinstance(model, EditedModel):
        return model.base, list(model.patches)
    return model, []


def with_writes(model, writes: list[TensorWrite]):
    """``model`` with ``writes`` applied on top (a scratch patch; nothing is stored)."""
    base, patches = base_and_patches(model)
    if not writes:
        return model
    scratch = Patch(name="(fitting)", base_digest=base.digest, base_name=base.name,
                    edits=[Edit(id=0, mode="memit", prompt="", target="", target_id=0, layers=[], writes=writes)])
    return EditedModel(base, patches + [scratch])


def ffn_op(plan, layer: int, what: str):
    n = len(plan.layers)
    if not 0 <= layer < n:
        raise QueryRefused(f"{what} names layer {layer}, but the model has {n} layers (0..{n - 1})")
    op = next((o for o in plan.layers[layer].slot_ops() if o.role == "ffn"), None)
    if op is None:
        raise QueryRefused(f"{what}: layer {layer} is a {plan.layers[layer].operator} layer with no FFN to edit")
    from ..operators import FeatureFfn

    if op.operator is None or not isinstance(op.operator, FeatureFfn) or "ffn_down" not in op.operands:
        raise QueryRefused(f"{what}: layer {layer}'s FFN {op.kind!r} is not a feature FFN with a down projection "
                           "(edits write FFN features: gated_ffn and mlp_ffn)")
    return op


def feature_view(ex, op):
    from ..exec.engine import slot_operands

    return op.operator.feature_view(op.params, slot_operands(op, ex.prepared))


class _Keep:
    """An observer keeping, per asked layer, the FFN input and the residual leaving the layer."""

    def __init__(self, layers):
        from ..exec.engine import Observer

        self._o = Observer()
        self.layers = set(layers)
        self.x: dict[int, list] = {i: [] for i in self.layers}
        self.h: dict[int, list] = {i: [] for i in self.layers}

    def begin(self, p0, h):
        pass

    def enter(self, layer, p0, h):
        pass

    def write(self, layer, site, p0, w, r):
        pass

    def slot_input(self, layer, site, p0, x):
        if site == "ffn" and layer in self.layers:
            self.x[layer].append(x)

    def leave(self, layer, p0, h):
        if layer in self.layers:
            self.h[layer].append(h)


@dataclass
class Probe:
    x: dict[int, np.ndarray]  # layer -> FFN input [T, hidden]
    h: dict[int, np.ndarray]  # layer -> residual leaving the layer [T, hidden]
    logits: np.ndarray  # [vocab] at the last position
    final: np.ndarray  # [hidden] the last residual (before the final norm)


def probe(ex, ids, layers) -> Probe:
    keep = _Keep(layers)
    st = ex.start(observer=keep)
    logits = st.prefill(ids, last_only=True)[-1]
    return Probe({i: np.concatenate(v) for i, v in keep.x.items()}, {i: np.concatenate(v) for i, v in keep.h.items()},
                 logits, st.last_hidden[-1])


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def grad_logp(readout, head: np.ndarray, h: np.ndarray, p: np.ndarray, target: int) -> np.ndarray:
    """d log P(target) / d h for the last residual h, exactly through an RMS final norm and the
    head (a LayerNorm final norm is treated as its scale alone)."""
    v = head[target] - (p.astype(F32) @ head)
    gv = readout.norm_weight * v
    if readout.norm_kind != "rms":
        return gv
    H = F32(h.shape[0])
    n = np.sqrt(np.mean(h * h) + readout.eps)
    return gv / n - h * (F32(h @ gv) / (H * n * n * n))


def residual_target(ex, ids, layer: int, target: int, goal: float, iters: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """A change dz of the residual leaving ``layer`` at the last position that brings P(target)
    to ``goal`` (or as close as ``iters`` steps get). Returns (h there, dz, figures)."""
    from ..exec.intervention import Patch as ResidualPatch

    T = len(ids)
    pr = probe(ex, ids, [layer])
    h = pr.h[layer][-1].copy()
    head = ex.readout.head.dense()
    scale = F32(np.linalg.norm(h))
    dz = np.zeros_like(h)
    logits, final = pr.logits, pr.final
    p = softmax(logits)
    p0 = float(p[target])
    steps = 0
    for steps in range(1, iters + 1):
        if p[target] >= goal:
            steps -= 1
            break
        g = grad_logp(ex.readout, head, final, p, target)
        dz = dz + F32(0.2) * scale * (g / F32(np.linalg.norm(g) + 1e-20))
        st = ex.start(interventions=[ResidualPatch("residual_post", layer, (T - 1,), (h + dz)[None, :])])
        logits = st.prefill(ids, last_only=True)[-1]
        final = st.last_hidden[-1]
        p = softmax(logits)
    return h, dz.astype(F32), {"p_before": round(p0, 4), "p_reached": round(float(p[target]), 4), "steps": steps,
                               "dz_norm": round(float(np.linalg.norm(dz)), 3)}


# ---- corpus statistics ---------------------------------------------------------------------------

_STATS: dict = {}
#: The corpus used when none is named (None: the frozen prompt bank); a test sets a small one.
DEFAULT_CORPUS: str | None = None


def corpus_texts(settings: FitSettings) -> tuple[list[str], str, str]:
    """The corpus texts, its name and sha256."""
    from ..draft.bank import default_bank, file_sha256, load_prompts

    named = settings.corpus or DEFAULT_CORPUS
    path = Path(named) if named else default_bank()
    prompts = load_prompts(path)
    texts = [p.text for p in prompts if p.text is not None]
    return texts, path.name, file_sha256(path)


def corpus_stats(model, layers, settings: FitSettings, *, cov: bool) -> dict:
    """Per layer: mean FFN input ``mu``, mean residual leaving it ``center`` and (with ``cov``)
    the FFN key second moment ``C`` = mean of k k^T over every corpus position, from the base
    container (edits do not move them). Cached per (container, corpus, generate, layer)."""
    base, _ = base_and_patches(model)
    texts, name, sha = corpus_texts(settings)
    key = (base.digest, sha, settings.generate)
    cov = True  # the covariance costs little beside the pass, and one pass then serves every mode
    want = [i for i in layers if (key, i, True) not in _STATS]
    if want:
        ex = base.executor()
        plan = base.op_plan()
        ops = {i: ffn_op(plan, i, "the corpus statistics") for i in want} if cov else {}
        views = {i: feature_view(ex, op) for i, op in ops.items()}
        keep = _Keep(want)
        tok = base.tokenizer
        positions = 0
        firsts = {i: [] for i in want}  # the pass holding each text's first position
        cut = 0
        for t in texts:
            ids = tok.encode(t)
            if ex.max_positions is not None and len(ids) + settings.generate > ex.max_positions:
                ids, cut = ids[:max(1, ex.max_positions - settings.generate)], cut + 1  # the context length
            for i in want:
                firsts[i].append(len(keep.h[i]))
            st = ex.start(observer=keep)
            logits = st.prefill(ids, last_only=True)[-1]
            positions += len(ids)
            for _ in range(settings.generate):
                nxt = int(np.argmax(logits))
                logits = st.step(nxt)
                positions += 1
        for i in want:
            x = np.concatenate(keep.x[i]) if keep.x[i] else None
            h = np.concatenate(keep.h[i])
            # the centre leaves out each text's first position: its residual (the attention sink)
            # is many times larger than the others and would dominate the mean
            rest = np.concatenate([a[1:] if j in set(firsts[i]) else a for j, a in enumerate(keep.h[i])])
            s = {"center": rest.mean(axis=0).astype(F32), "positions": int(h.shape[0]), "cut": cut}
            if x is not None:
                s["mu"] = x.mean(axis=0).astype(F32)
            if cov:
                k = views[i].activations(x).astype(np.float64)
                s["C"] = (k.T @ k) / k.shape[0]
            _STATS[(key, i, cov)] = s
    out = {}
    for i in layers:
        out[i] = _STATS[(key, i, True)]
    return {"layers": out, "corpus": name, "corpus_sha256": sha, "generate": settings.generate,
            "positions": next(iter(out.values()))["positions"] if out else 0,
            "cut": next(iter(out.values()))["cut"] if out else 0}


def provenance_of(stats: dict) -> dict:
    return {"corpus": stats["corpus"], "corpus_sha256": stats["corpus_sha256"][:16],
            "texts_cut_to_the_context_length": stats["cut"],
            "generated_tokens_per_prompt": stats["generate"], "positions": stats["positions"],
            "note": "the frozen prompt bank plus text the model generated from it" if stats["corpus"] == "prompts-v1.jsonl"
            else "the corpus named, plus text the model generated from it"}


# ---- MEMIT ---------------------------------------------------------------------------------------


def memit_solve(K: np.ndarray, R: np.ndarray, C: np.ndarray, lam: float, ridge: float,
                Kp: np.ndarray | None = None, mu: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """MEMIT's closed form for one layer: keys K [I, n], residuals R [H, n], key second moment C
    [I, I]. Returns (R, A) with A = K^T (lam (C + ridge·mean(diag C)·I) + K K^T + mu Kp Kp^T)^-1
    [n, I], so the update is ΔW = R @ A (float32): the change minimising |ΔW K - R|² + lam ·
    tr(ΔW C' ΔW^T) + mu |ΔW Kp|², i.e. mapping each key to its residual while weighing the corpus
    keys by ``lam`` and keeping the preservation keys Kp [I, m] (W Kp = W0 Kp) with weight ``mu``
    each. Solved in float64."""
    K64 = K.astype(np.float64)
    I = K64.shape[0]
    Creg = C + (ridge * float(np.mean(np.diag(C))) + 1e-12) * np.eye(I)
    M = lam * Creg + K64 @ K64.T
    if Kp is not None and mu > 0:
        P64 = Kp.astype(np.float64)
        if P64.shape[0] != I:
            raise QueryRefused(f"preservation keys of width {P64.shape[0]} against a layer's keys of width {I}")
        M = M + mu * (P64 @ P64.T)
    A = np.linalg.solve(M, K64).T
    return R.astype(F32), A.astype(F32)


#: bound on a preservation corpus (lines), checked before any key is read
MAX_PRESERVE = 4096
_PRESERVE: dict = {}


def preservation(model, reqs: list[Request], layers: list[int], settings: FitSettings) -> tuple[dict, dict] | None:
    """MEMIT's preservation keys: per layer, the FFN keys at the subject's last token of every line
    of ``settings.preserve`` (a JSONL of {prompt, subject}: held-out subjects of the edited
    relations), read once from ``model`` before the batch writes anything (bare prompts, no context
    prefixes). Returns ({layer: Kp [I, m]}, the record) or None without a corpus. A line whose
    prompt is an edited prompt is refused by name (it cannot be kept and changed at once)."""
    if not settings.preserve:
        return None
    from .. import jsonio
    from ..draft.bank import file_sha256
    from ..paths import existing_file, read_regular

    if not settings.preserve_weight > 0:
        raise QueryRefused(f"a preservation corpus ({Path(settings.preserve).name}) with weight "
                           f"{settings.preserve_weight:g} keeps nothing", hint="preserve_weight > 0")
    path = Path(settings.preserve)
    name = path.name
    lines = jsonio.decode_text(read_regular(existing_file(path, "preservation corpus"), "preservation corpus",
                                            max_bytes=16 << 20), name).splitlines()
    rows = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        d = jsonio.loads(line, source=f"{name} line {n}")
        if not isinstance(d, dict) or not isinstance(d.get("prompt"), str) or not isinstance(d.get("subject"), str):
            raise QueryRefused(f"{name} line {n}: a preservation line is {{\"prompt\": text, \"subject\": text}}")
        rows.append((d["prompt"], d["subject"]))
    if not rows:
        raise QueryRefused(f"{name}: the preservation corpus holds no lines")
    if len(rows) > MAX_PRESERVE:
        raise QueryRefused(f"{name}: {len(rows)} preservation lines, above the bound of {MAX_PRESERVE}")
    edited = {r.prompt for r in reqs}
    for prompt, _ in rows:
        if prompt in edited:
            raise QueryRefused(f"the preservation corpus {name} holds the edited prompt {prompt!r}: a fact cannot be "
                               "kept and changed at once")
    base, patches = base_and_patches(model)
    tok = base.tokenizer
    sha = file_sha256(path)
    key = (base.digest, tuple(p.digest() for p in patches), sha, tuple(layers))
    if key not in _PRESERVE:
        ex = model.executor()
        plan = base.op_plan()
        views = {i: feature_view(ex, ffn_op(plan, i, "MODE MEMIT")) for i in layers}
        ks: dict[int, list] = {i: [] for i in layers}
        for prompt, subject in rows:
            ids, pos = subject_position(tok, prompt, subject)
            pr = probe(ex, ids, layers)
            for i in layers:
                ks[i].append(views[i].activations(pr.x[i][pos:pos + 1])[0])
        _PRESERVE[key] = {i: np.stack(v, axis=1).astype(F32) for i, v in ks.items()}
    record = {"corpus": name, "corpus_sha256": sha[:16], "keys": len(rows), "weight": settings.preserve_weight,
              "note": "FFN keys at the subject's last token of held-out prompts of the edited relations, read before "
                      "the batch's writes; the closed form keeps W Kp = W0 Kp with this weight per key"}
    return _PRESERVE[key], record


def subject_position(tok, prompt: str, subject: str | None, prefix: str = "") -> tuple[list[int], int]:
    """The token ids of ``prefix + prompt`` and the index of the subject's last token in them:
    the first occurrence of ``subject`` in ``prompt``, whose end must be a token boundary of the
    prompt's tokenization. Refused by name otherwise."""
    if not subject:
        raise QueryRefused("MODE MEMIT keys at the subject's last token, and this edit names no entity",
                           hint="INSERT INTO EDGES (entity, relation, target) or (prompt, target, entity)")
    i = prompt.find(subject)
    if i < 0:
        raise QueryRefused(f"the entity {subject!r} does not occur in the prompt {prompt!r}, so its last token "
                           "cannot be located (MODE MEMIT keys there)")
    ids = list(tok.encode(prefix + prompt))
    head = list(tok.encode(prefix + prompt[:i + len(subject)]))
    if not head or ids[:len(head)] != head:
        raise QueryRefused(f"the end of the entity {subject!r} in the prompt {prompt!r} is not a token boundary of "
                           "the prompt's tokenization, so its last token cannot be located")
    return ids, len(head) - 1


_CONTEXTS: dict = {}
#: the seed words ROME generates its context prefixes from
CONTEXT_SEEDS = ("The", "Therefore", "Because", "I", "You")


def context_prefixes(model, settings: FitSettings) -> list[str]:
    """``settings.contexts`` prefixes (at most 5), each a seed word and the ``context_tokens`` tokens
    the unedited model generates greedily after it, then '. ': the texts a subject's key and value
    are averaged over besides the bare prompt (ROME's context templates, generated greedily here so
    that a fit is deterministic). Cached per container."""
    base, _ = base_and_patches(model)
    n = settings.contexts
    if not 0 <= n <= len(CONTEXT_SEEDS):
        raise QueryRefused(f"MEMIT averages over at most {len(CONTEXT_SEEDS)} context prefixes; {n} were asked")
    key = (base.digest, n, settings.context_tokens)
    if key not in _CONTEXTS:
        ex = base.executor()
        tok = base.tokenizer
        out = []
        for seed in CONTEXT_SEEDS[:n]:
            ids = list(tok.encode(seed, special=False))
            st = ex.start()
            logits = st.prefill(ids, last_only=True)[-1]
            for _ in range(settings.context_tokens):
                ids.append(int(np.argmax(logits)))
                logits = st.step(ids[-1])
            out.append(tok.decode(ids).replace("\n", " ").strip() + ". ")
        _CONTEXTS[key] = out
    return _CONTEXTS[key]


def _adam(tail, prepared, h0, settings):
    """The value fit's Adam loop (`fit_value`). Returns (delta float64, steps, first and last mean NLL, KL)."""
    hn2 = float(h0 @ h0)
    n_nll = sum(1 for p in prepared if p[3] == "nll")
    delta = np.zeros(h0.shape, np.float64)
    m = np.zeros_like(delta)
    v = np.zeros_like(delta)
    b1, b2, eps = 0.9, 0.999, 1e-8
    steps, nll_mean, kl_v, nll_first = 0, None, 0.0, None
    for steps in range(1, settings.v_steps + 1):
        g = np.zeros_like(delta)
        nll_sum, kl_v = 0.0, 0.0
        d32 = delta.astype(F32)
        for h, pos, row, kind, loss in prepared:
            x = h.copy()
            x[pos] += d32
            val, dh, _ = tail.value_and_grad(x, [row], loss)
            w = 1.0 / n_nll if kind == "nll" else settings.v_kl
            if kind == "nll":
                nll_sum += val
            else:
                kl_v = val
            g += w * dh[pos].astype(np.float64)
        nll_mean = nll_sum / n_nll
        if nll_first is None:
            nll_first = nll_mean
        if nll_mean < settings.v_stop:
            steps -= 1
            break
        g += settings.v_decay * 2 * delta / hn2
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        delta = delta - settings.v_lr * (m / (1 - b1 ** steps)) / (np.sqrt(v / (1 - b2 ** steps)) + eps)
        cap = settings.v_clamp * np.sqrt(hn2)
        nd = float(np.linalg.norm(delta))
        if nd > cap:
            delta *= cap / nd
    return delta, steps, nll_first, nll_mean, kl_v


def fit_value(model, r: Request, layer: int, settings: FitSettings, contexts: list[str]) -> tuple[np.ndarray, np.ndarray, dict]:
    """ROME / MEMIT's value: a change ``delta`` of the residual leaving ``layer`` at the subject's
    last token, shared by the bare prompt and each context prefix, minimising the target's mean
    negative log-probability over them + ``v_kl`` · KL(unedited || edited) of the next token after
    '{subject} is a' (delta added at its subject too) + ``v_decay`` · |delta|² / |h|², by at most
    ``v_steps`` Adam steps of rate ``v_lr`` (from zero; |delta| clamped to ``v_clamp`` · |h|), with the
    exact gradient of `vindex3.edits.grad`. Returns (h at the bare prompt, delta, figures)."""
    import time

    from ..exec.engine import small_pass_threads
    from . import grad

    ex = model.executor()
    base, _ = base_and_patches(model)
    tok = base.tokenizer
    plan = base.op_plan()
    grad.check_tail(plan, layer)
    if settings.v_steps < 0 or settings.v_steps > 1000:
        raise QueryRefused(f"a value fit takes 0..1000 steps; {settings.v_steps} were asked")
    runs = []  # (ids, row of the subject, loss kind)
    for pre in ["", *contexts]:
        ids, pos = subject_position(tok, r.prompt, r.entity, pre)
        runs.append((ids, pos, "nll"))
    if runs[0][1] != len(runs[0][0]) - 1 and layer == len(plan.layers) - 1:
        raise QueryRefused(f"MODE MEMIT's value at layer {layer}, the model's last, cannot reach the prompt's last token "
                           f"from the subject's ({r.entity!r} ends before it): no attention layer follows",
                           hint="end the LAYERS range before the last layer")
    essence = f"{r.entity} is a"
    e_ids, e_pos = subject_position(tok, essence, r.entity)
    runs.append((e_ids, e_pos, "kl"))
    # the bound, before any weight is read: per step each run's forward and backward through the tail
    # (about 3x the forward's 2 flops per weight and position) and the head at one row
    tail_w = sum(int(np.prod(ref.shape)) for lo in plan.layers[layer + 1:] for op in lo.ops
                 for ref in op.operands.values())
    head_w = int(np.prod(plan.head.operands["weight"].shape))
    gflop = settings.v_steps * sum(6 * (len(ids) * tail_w + head_w) for ids, _, _ in runs) / 1e9
    if gflop > settings.max_gflop:
        raise QueryRefused(f"the value fit at layer {layer} would take about {gflop:.0f} GFLOP ({settings.v_steps} steps, "
                           f"{len(runs)} prompts), above the bound of {settings.max_gflop:.0f}")
    t0 = time.perf_counter()
    tail = grad.Tail(ex, layer)
    prepared = []
    for ids, pos, kind in runs:
        pr = probe(ex, ids, [layer])
        h = pr.h[layer]
        if kind == "nll":
            loss = grad.nll([r.target_id])
        else:
            loss = grad.kl_from(grad.log_softmax(pr.logits.astype(F32)[None]))
        prepared.append((h, pos, len(ids) - 1, kind, loss))
    h0 = prepared[0][0][prepared[0][1]].copy()
    # the tail's forward is the executor's (same operators; another summation order)
    mine = tail.logits(prepared[0][0], [prepared[0][2]])[0]
    unedited = probe(ex, runs[0][0], []).logits
    gap = float(np.max(np.abs(mine - unedited)))
    scale = float(np.max(np.abs(mine))) + 1e-6
    if gap > 1e-3 * scale:
        raise QueryRefused(f"the gradient's forward through layers {layer + 1}.. differs from the executor's by {gap:.3g} "
                           f"(logits up to {scale:.3g}), so its gradient would not be the executor's")
    with small_pass_threads():  # small products: BLAS's spinning workers only slow them on a busy machine
        delta, steps, nll_first, nll_mean, kl_v = _adam(tail, prepared, h0, settings)
    delta32 = delta.astype(F32)    # what the executor says with delta in place at the bare prompt
    from ..exec.intervention import Patch as ResidualPatch

    ids0, pos0 = runs[0][0], runs[0][1]
    st = ex.start(interventions=[ResidualPatch("residual_post", layer, (pos0,), (h0 + delta32)[None, :])])
    p = softmax(st.prefill(ids0, last_only=True)[-1])
    p0 = softmax(unedited)
    return h0, delta32, {"key": "subject", "subject_token": pos0, "z_layer": layer, "p_before": round(float(p0[r.target_id]), 4),
                         "p_reached": round(float(p[r.target_id]), 4), "steps": steps,
                         "nll_before": round(float(nll_first), 4) if nll_first is not None else None,
                         "nll": round(float(nll_mean), 4) if nll_mean is not None else None,
                         "essence_kl": round(float(kl_v), 4), "dz_norm": round(float(np.linalg.norm(delta32)), 3),
                         "h_norm": round(float(np.linalg.norm(h0)), 3), "contexts": list(contexts),
                         "gflop_bound": round(gflop, 1), "seconds": round(time.perf_counter() - t0, 2)}


def _subject_keys(ex, view, reqs, layer: int, top: int, contexts: list[str], tok):
    """Per request: the FFN key (the down projection's input) at ``layer`` at the subject's last
    token, averaged over the bare prompt and the context prefixes; and the residual leaving ``top``
    there in the bare prompt."""
    keys, tops = [], []
    for r in reqs:
        ks = []
        for j, pre in enumerate(["", *contexts]):
            ids, pos = subject_position(tok, r.prompt, r.entity, pre)
            pr = probe(ex, ids, sorted({layer, top}) if j == 0 else [layer])
            ks.append(view.activations(pr.x[layer][pos:pos + 1])[0])
            if j == 0:
                tops.append(pr.h[top][pos])
        keys.append(np.mean(np.stack(ks), axis=0).astype(F32))
    return keys, tops


def fit_memit(model, reqs: list[Request], layers: list[int], settings: FitSettings) -> list[tuple[list[TensorWrite], dict]]:
    """MEMIT over ``layers`` for a batch of requests: the residual target is found at the output
    of the last layer (with ``key = "subject"``: ROME / MEMIT's value fit at the subject's last
    token, `fit_value`; with ``"last-token"``: the first-order search at the prompt's last token);
    each layer in turn (keys recomputed on the model as edited so far) takes its share of what is
    still missing. Returns per request (its writes, its fit record): request i's part of each
    layer's update is the rank-one term R[:, i] A[i]."""
    if settings.key not in ("subject", "last-token"):
        raise QueryRefused(f"MEMIT key {settings.key!r} is not one of subject, last-token")
    base, _ = base_and_patches(model)
    plan = base.op_plan()
    layers = sorted(set(layers))
    ops = {i: ffn_op(plan, i, "MODE MEMIT") for i in layers}
    top = layers[-1]
    subject = settings.key == "subject"
    lam = settings.lam_subject if subject else settings.lam
    tok = base.tokenizer
    if subject:
        for r in reqs:  # refused before any work: every subject must be located
            subject_position(tok, r.prompt, r.entity)
    stats = corpus_stats(model, layers, settings, cov=True)
    kept = preservation(model, reqs, layers, settings)
    ex = model.executor()
    contexts = context_prefixes(model, settings) if subject else []
    z, fits = [], []
    for r in reqs:
        if subject:
            h, dz, fig = fit_value(model, r, top, settings, contexts)
        else:
            h, dz, fig = residual_target(ex, r.ids, top, r.target_id, settings.goal, settings.max_iters)
            fig = {"key": "last-token", **fig}
        z.append(h + dz)
        fits.append(fig)
    Z = np.stack(z, axis=1)  # [H, n]
    writes: list[list[TensorWrite]] = [[] for _ in reqs]
    pending: list[TensorWrite] = []
    for j, layer in enumerate(layers):
        cur = with_writes(model, pending).executor()
        op = ops[layer]
        view = feature_view(cur, op)
        if subject:
            keys, tops = _subject_keys(cur, view, reqs, layer, top, contexts, tok)
        else:
            keys, tops = [], []
            for r in reqs:
                pr = probe(cur, r.ids, sorted({layer, top}))
                keys.append(view.activations(pr.x[layer][-1:])[0])
                tops.append(pr.h[top][-1])
        K = np.stack(keys, axis=1)
        R = (Z - np.stack(tops, axis=1)) / F32(len(layers) - j)
        left, A = memit_solve(K, R, stats["layers"][layer]["C"], lam, settings.ridge,
                              kept[0][layer] if kept else None, settings.preserve_weight if kept else 0.0)
        ref = op.operands["ffn_down"]
        for i in range(len(reqs)):
            w = TensorWrite.lowrank(ref.object, ref.tensor, ref.shape, left[:, i:i + 1], A[i:i + 1])
            writes[i].append(w)
            pending.append(w)
    prov = provenance_of(stats)
    extra = {"value_fit": settings.value_record()} if subject else {"key": "last-token"}
    extra["preservation"] = kept[1] if kept else None
    return [(writes[i], {**fits[i], "covariance": prov, "lambda": lam, "ridge": settings.ridge, **extra})
            for i in range(len(reqs))]


# ---- COMPOSE -------------------------------------------------------------------------------------


def fit_compose(model, r: Request, layer: int, settings: FitSettings) -> tuple[list[TensorWrite], dict]:
    """One FFN feature for the fact at ``layer``, written over the weakest feature not already
    holding an edit: gate row along the prompt's FFN input less the corpus mean (so that inputs
    unlike it stay below the gate), up row along the input itself, both at the layer's median row
    norms; down column along the residual change that raises the target, rescaled until the
    target's probability lands in [floor, ceiling] (and above the original's, when known)."""
    from ..exec.ops.ffn import activation

    base, _ = base_and_patches(model)
    plan = base.op_plan()
    op = ffn_op(plan, layer, "MODE COMPOSE")
    if not {"ffn_gate", "ffn_up", "ffn_down"} <= set(op.operands):
        raise QueryRefused(f"MODE COMPOSE: layer {layer}'s FFN has no separate gate and up projections "
                           f"(it has {', '.join(sorted(op.operands))}); COMPOSE writes one gated feature")
    stats = corpus_stats(model, [layer], settings, cov=False)
    ex = model.executor()
    pr = probe(ex, r.ids, [layer])
    x = pr.x[layer][-1]
    view = feature_view(ex, op)
    gate_w = view.keys
    up_w = (ex.prepared.weight(op.operands["ffn_up"])).dense()
    down_w = view.values
    used = {e.fit.get("feature") for e in (model.edits() if isinstance(model, EditedModel) else [])
            if e.mode == "compose" and e.layers == [layer]}
    strength = np.linalg.norm(gate_w, axis=1) * np.linalg.norm(up_w, axis=1) * np.linalg.norm(down_w, axis=0)
    order = [int(f) for f in np.argsort(strength, kind="stable") if int(f) not in used]
    f = order[0]
    u = x - stats["layers"][layer]["mu"]
    u_hat = (u / np.linalg.norm(u)).astype(F32)
    x_hat = (x / np.linalg.norm(x)).astype(F32)
    ng = F32(np.median(np.linalg.norm(gate_w, axis=1)))
    nu = F32(np.median(np.linalg.norm(up_w, axis=1)))
    gate_row, up_row = ng * u_hat, nu * x_hat
    a0 = float(activation(op.params.activation)(np.asarray([gate_row @ x], F32))[0] * (up_row @ x))
    _, dz, fig = residual_target(ex, r.ids, layer, r.target_id, settings.ceiling, settings.max_iters)
    d_hat = dz / F32(np.linalg.norm(dz) + 1e-20)
    beta = float(np.linalg.norm(dz)) / max(a0, 1e-6)
    g, up, dn = op.operands["ffn_gate"], op.operands["ffn_up"], op.operands["ffn_down"]

    def writes_for(b: float) -> list[TensorWrite]:
        return [TensorWrite.row(g.object, g.tensor, g.shape, f, gate_row),
                TensorWrite.row(up.object, up.tensor, up.shape, f, up_row),
                TensorWrite.col(dn.object, dn.tensor, dn.shape, f, (F32(b) * d_hat).astype(F32))]

    orig = r.original_id
    pt = po = 0.0
    tries = 0
    last = None  # (beta, p_target) before the last growth: growth stops when it no longer helps
    for tries in range(1, settings.max_iters + 1):
        p = softmax(probe(with_writes(model, writes_for(beta)).executor(), r.ids, [layer]).logits)
        pt, po = float(p[r.target_id]), (float(p[orig]) if orig is not None else 0.0)
        if last is not None and pt <= last[1] * 1.01:
            beta, pt = last  # saturated: the target's probability no longer rises with the feature's norm
            break
        if pt < settings.floor or (orig is not None and pt <= po):
            last = (beta, pt)
            beta *= 1.5
        elif pt > settings.ceiling:
            beta /= 1.25
        else:
            break
    return writes_for(beta), {"feature": f, "replaced_strength": round(float(strength[f]), 6),
                              "gate_norm": round(float(ng), 4), "up_norm": round(float(nu), 4),
                              "down_norm": round(beta, 4), "activation_at_key": round(a0, 4),
                              "p_before": fig["p_before"], "p_fitted": round(pt, 4), "rescales": tries,
                              "corpus": provenance_of(stats)}


# ---- KNN -----------------------------------------------------------------------------------------


def fit_knn(model, r: Request, layer: int, settings: FitSettings) -> tuple[KnnKey, dict]:
    """The retrieval overlay's key: the residual leaving ``layer`` at the prompt's last token, less
    the corpus mean there."""
    base, _ = base_and_patches(model)
    n = len(base.op_plan().layers)
    if not 0 <= layer < n:
        raise QueryRefused(f"MODE KNN names layer {layer}, but the model has {n} layers (0..{n - 1})")
    stats = corpus_stats(model, [layer], settings, cov=False)
    ex = model.executor()
    pr = probe(ex, r.ids, [layer])
    c = stats["layers"][layer]["center"]
    key = pr.h[layer][-1] - c
    k = KnnKey(layer=layer, hidden=int(key.shape[0]), key=enc(key), center=enc(c), threshold=settings.threshold,
               token_id=r.target_id)
    return k, {"key_sha256": hashlib.sha256(key.tobytes()).hexdigest()[:16], "corpus": provenance_of(stats)}


# ---- edits ---------------------------------------------------------------------------------------


def default_layers(n: int, mode: str) -> list[int]:
    """The layers a mode writes when none are named (documented in docs/editing.md)."""
    if mode == "memit":
        lo, hi = (n * 3) // 5, (n * 3) // 4
        return list(range(lo, max(hi, lo) + 1))
    return [min(n - 1, (n * 2) // 3)]


def make_edits(model, patch: Patch, reqs: list[Request], mode: str, layers: list[int] | None,
               settings: FitSettings) -> list[Edit]:
    """Fit ``reqs`` on ``model`` (which already holds ``patch``'s edits, if it is open) and append
    them to ``patch``. MEMIT fits the requests as one batch; COMPOSE and KNN one by one, each on
    the model as edited by the ones before."""
    base, _ = base_and_patches(model)
    n = len(base.op_plan().layers)
    layers = sorted(set(layers)) if layers else default_layers(n, mode)
    for i in layers:
        if not 0 <= i < n:
            raise QueryRefused(f"MODE {mode.upper()} names layer {i}, but the model has {n} layers (0..{n - 1})")
    if mode in ("compose", "knn") and len(layers) != 1:
        raise QueryRefused(f"MODE {mode.upper()} writes at one layer (AT LAYER n); LAYERS {layers[0]}-{layers[-1]} "
                           "names several", hint="LAYERS a-b is for MODE MEMIT")
    ex = model.executor()
    for r in reqs:
        if r.original_id is None:
            r.original_id = int(np.argmax(probe(ex, r.ids, []).logits))
    out: list[Edit] = []

    def edit(r: Request, **kw) -> Edit:
        tok = base.tokenizer
        e = Edit(id=patch.next_id(), mode=mode, prompt=r.prompt, target=r.target, target_id=r.target_id,
                 original=tok.decode([r.original_id]) if r.original_id is not None else None, entity=r.entity,
                 relation=r.relation, layers=layers, **kw)
        patch.edits.append(e)
        out.append(e)
        return e

    if mode == "memit":
        for r, (writes, fit) in zip(reqs, fit_memit(model, reqs, layers, settings)):
            edit(r, writes=writes, fit={**fit, "settings": settings.record()})
        return out
    cur = model
    for r in reqs:
        if mode == "compose":
            writes, fit = fit_compose(cur, r, layers[0], settings)
            edit(r, writes=writes, fit={**fit, "settings": settings.record()})
        elif mode == "knn":
            key, fit = fit_knn(cur, r, layers[0], settings)
            edit(r, knn=key, fit={**fit, "settings": settings.record()})
        else:
            raise QueryRefused(f"MODE {mode.upper()} is not an edit mode (modes: KNN, COMPOSE, MEMIT)")
        base_, patches = base_and_patches(cur)
        cur = EditedModel(base_, [p for p in patches if p is not patch] + [patch])
    return out
