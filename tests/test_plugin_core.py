"""The plug-in core: operators registered by name, state made of parts, weights that know their
encoding, and an executor whose streams keep their own traces.

The first test is the acceptance test of the plug-in design: a toy operator (a scaled identity
mixer with a one-number recurrent state) and a toy family are registered from this module alone,
a tiny model that uses them is encoded, and STATS, EXPLAIN, INFER, a draft, speculation (which
needs snapshot/restore) and snapshot/restore themselves run through LQL and the Python API, with
the answer computed independently here in numpy. Nothing under vindex3/ knows the toy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fixtures import VOCAB, build_tokenizer, reseal
from pydantic import Field

import lql
import vindex3
from vindex3 import operators
from vindex3.continuation import RECURRENT, Geometry, buffer
from vindex3.errors import ClosureError, GraphSchemaError, IntegrityError, UnsupportedEncoding
from vindex3.exec.state import BufferState
from vindex3.families.base import ConfigReader, Lowering, register_family, unregister_family
from vindex3.families.placement import assemble_graph, place_tensors

IDS = [5, 17, 99, 3, 250, 42, 7, 7, 123, 31]

# ---- the toy operator: y_t = w * x_t + c_t, with c_t = decay * c_(t-1) + mean(x_t) -------------


class ToyParams(operators.Params):
    hidden_size: int = Field(gt=0)
    decay: float


class ToyState(BufferState):
    names = ("acc",)


class ToyKernel(operators.Kernel):
    def __init__(self, p: ToyParams, w: np.ndarray):
        self.decay, self.w = np.float32(p.decay), w

    def prefill(self, x, state, p0):
        y = np.empty_like(x)
        c = state.acc[0]
        for t in range(x.shape[0]):
            c = self.decay * c + np.mean(x[t], dtype=np.float32)
            y[t] = self.w * x[t] + c
        state.acc[0] = c
        return y


class ToyScaled(operators.Operator):
    name = "toy_scaled"
    slot = operators.MIXER
    selects = "toy_scaled"
    operator_group = "toy_scaled"
    Params = ToyParams

    def params(self, surface, layer):
        raw = {**surface["operators"]["toy_scaled"], "hidden_size": surface["hidden_size"]}
        return operators.parse_params(ToyParams, raw, f"layer {layer.index} (toy_scaled)")

    def roles(self, p):
        return [operators.Role("toy_scale", (p.hidden_size,), True, operators.ARRAY)]

    def geometry(self, p):
        return Geometry((buffer("acc", (1,)),))

    def new_state(self, p):
        return ToyState(acc=np.zeros(1, np.float32))

    def summary(self, p):
        return {"decay": p.decay}

    def bind(self, p, operands):
        return ToyKernel(p, operands["toy_scale"])


# ---- the toy family: model_type "toy_scaled", tensors toy.embed / toy.layers.N.* / toy.head ----

H, L, INTER, DECAY, EPS = 24, 3, 40, 0.5, 1e-5
PREFIXES = (("toy.embed.", "embedding"), ("toy.layers.", "decoder_stack"), ("toy.norm.", "final_norm"),
            ("toy.head.", "output_head"))
LAYER_ROLES = {"norm1.weight": "mixer_norm", "scale": "toy_scale", "norm2.weight": "ffn_norm",
               "gate.weight": "ffn_gate", "up.weight": "ffn_up", "down.weight": "ffn_down"}


def build_toy(r: ConfigReader, src) -> Lowering:
    hidden = r.take("hidden_size", "residual width")
    n = r.take("num_hidden_layers", "layers")
    vocab = r.take("vocab_size", "vocabulary")
    decay = r.take("toy_decay", "decay of the running mean")
    inter = r.take("intermediate_size", "FFN width")
    layers = [{"index": i, "operator": "toy_scaled", "span": None, "window": None, "position": None, "ffn": "dense",
               "operands": {}} for i in range(n)]
    surface = {
        "hidden_size": hidden, "embedding": {"multiplier": 1.0}, "residual": {"multiplier": 1.0},
        "ffn": {"kind": "gated", "activation": "silu", "intermediate_size": inter, "bias": False, "fused_gate_up": False},
        "norms": {"kind": "rms", "eps": EPS, "weight_offset": 0.0, "placement": "pre_mixer"},
        "head": {"vocab": vocab, "tied": False, "multiplier": 1.0, "softcap": None},
        "operators": {"toy_scaled": {"decay": decay}},
    }
    graph = assemble_graph(src.name, "toy_scaled", False, layers, surface)
    placements, dropped = place_tensors(src, graph, r, False, PREFIXES, lambda i: ("toy_scaled", LAYER_ROLES))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


def toy_weights(seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {"toy.embed.weight": rng.normal(0, 1, (VOCAB, H)), "toy.norm.weight": 1 + 0.3 * rng.normal(size=H),
         "toy.head.weight": rng.normal(0, 0.5, (VOCAB, H))}
    for i in range(L):
        w |= {f"toy.layers.{i}.norm1.weight": 1 + 0.3 * rng.normal(size=H), f"toy.layers.{i}.scale": rng.normal(size=H),
              f"toy.layers.{i}.norm2.weight": 1 + 0.3 * rng.normal(size=H),
              f"toy.layers.{i}.gate.weight": rng.normal(0, 0.3, (INTER, H)),
              f"toy.layers.{i}.up.weight": rng.normal(0, 0.3, (INTER, H)),
              f"toy.layers.{i}.down.weight": rng.normal(0, 0.3, (H, INTER))}
    return {k: v.astype(np.float32) for k, v in w.items()}


def toy_reference(w: dict[str, np.ndarray], ids: list[int], depth: int = L) -> np.ndarray:
    """The toy model in plain numpy, written from its definition (not from the executor)."""
    def rms(x, g):
        return g * (x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + EPS))

    h = w["toy.embed.weight"][ids].astype(np.float64)
    for i in range(depth):
        p = f"toy.layers.{i}."
        x = rms(h, w[p + "norm1.weight"])
        c, y = 0.0, np.empty_like(x)
        for t in range(len(ids)):
            c = DECAY * c + x[t].mean()
            y[t] = w[p + "scale"] * x[t] + c
        h = h + y
        x = rms(h, w[p + "norm2.weight"])
        g, u = x @ w[p + "gate.weight"].T, x @ w[p + "up.weight"].T
        h = h + (g / (1 + np.exp(-g)) * u) @ w[p + "down.weight"].T
    return rms(h, w["toy.norm.weight"]) @ w["toy.head.weight"].T


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from safetensors.numpy import save_file

    operators.register(ToyScaled)
    register_family("toy_scaled", "toy_scaled", build_toy)
    try:
        base = tmp_path_factory.mktemp("toy")
        ck = base / "toy-ckpt"
        ck.mkdir()
        w = toy_weights()
        save_file(w, str(ck / "model.safetensors"))
        (ck / "config.json").write_text(json.dumps({
            "model_type": "toy_scaled", "hidden_size": H, "num_hidden_layers": L, "vocab_size": VOCAB,
            "toy_decay": DECAY, "intermediate_size": INTER}))
        build_tokenizer(ck)
        out = vindex3.encode(ck, base / "toy.vindex3")
        yield out, w
    finally:
        operators.unregister("toy_scaled")
        unregister_family("toy_scaled")


def test_a_toy_operator_plugs_in_from_a_test_module(toy):
    path, w = toy
    assert ("toy_scaled", "mixer") in operators.registered()
    s = lql.Session()
    opened, stats, explain = s.execute(f"OPEN '{path}'; STATS AT 100 POSITIONS; EXPLAIN DRAFT DEPTH 2;")
    assert opened.layers == L and [m.label for m in opened.operator_mix] == ["toy_scaled"]
    c = stats.continuation
    assert (c.recurrent_layers, c.recurrent_bytes, c.kv_layers, c.latent_layers) == (L, L * 4, 0, 0)
    assert stats.state_bytes_at_positions == L * 4  # fixed: independent of the positions
    assert "12 bytes over 3 layer(s), constant in sequence length" in stats.to_text(timing=False)
    text = explain.to_text(timing=False)
    assert "layer 0: toy_scaled; state Recurrent{acc[1]:f32}, 4 bytes fixed" in text
    assert "toy_scaled    mixer           toy_scale" in text and "decay=0.5" in text
    assert explain.executed_layers == [0, 1]

    # INFER against the numpy model: the top token and its probability
    ref = toy_reference(w, IDS)
    (infer,) = s.execute(f"INFER TOKENS ({', '.join(map(str, IDS))}) TOP 3;")
    p = np.exp(ref[-1] - ref[-1].max())
    p /= p.sum()
    assert infer.top[0].id == int(np.argmax(ref[-1]))
    assert infer.top[0].probability == pytest.approx(float(p.max()), abs=1e-5)

    # a draft: the numpy model cut at depth 1
    (d,) = s.execute(f"INFER TOKENS ({', '.join(map(str, IDS))}) DRAFT DEPTH 1 TOP 1;")
    assert d.executed_layers == [0] and d.top[0].id == int(np.argmax(toy_reference(w, IDS, depth=1)[-1]))

    # speculation needs snapshot/restore of the toy's recurrence and must equal greedy
    (spec,) = s.execute(f"INFER TOKENS ({', '.join(map(str, IDS))}) GENERATE 8 SPECULATE DEPTH 1 LOOKAHEAD 3;")
    (greedy,) = s.execute(f"INFER TOKENS ({', '.join(map(str, IDS))}) GENERATE 8;")
    assert spec.rollback == "snapshot" and spec.generated_ids == greedy.generated_ids


def test_the_toy_state_snapshots_restores_and_refuses_truncation(toy):
    path, w = toy
    c = vindex3.open(path)
    ex = c.executor()
    ours = ex.forward(IDS)
    # 15x the same numpy toy's own float32-vs-float64 spread, 6.8e-6 (ours 5.9e-6 from the float64 one)
    assert np.max(np.abs(ours - toy_reference(w, IDS))) < 1e-4
    st = ex.start()
    st.prefill(IDS[:6])
    assert st.state.nbytes == L * 4 and [p.kind for p in c.continuation()[0].parts] == [RECURRENT]
    snap = st.snapshot()
    a = st.step(IDS[6])
    st.step(IDS[7])
    with pytest.raises(vindex3.errors.StateError, match="ToyState keeps a recurrence"):
        st.state.layers[0]["mixer"].truncate(6)
    with pytest.raises(vindex3.errors.StateError, match="rolls back only through snapshot"):
        st.truncate(6)
    st.restore(snap)
    assert st.position == 6 and np.array_equal(st.step(IDS[6]), a)


def test_builtin_operators_are_registered_with_their_slots():
    reg = dict(operators.registered())
    assert reg["softmax"] == reg["mamba2"] == "mixer" and reg["gated_ffn"] == "ffn"
    assert operators.selected("ffn", "dense").name == "gated_ffn"


def test_a_second_operator_cannot_take_a_registered_name():
    class Impostor(ToyScaled):
        name = "softmax"

    with pytest.raises(ValueError, match="already registered"):
        operators.register(Impostor)


# ---- streams ----------------------------------------------------------------------------------


def test_two_streams_from_one_executor_keep_their_own_traces(tiny_llama_container):
    c = vindex3.open(tiny_llama_container)
    ex = c.executor()
    a, b = ex.start(), ex.start()
    la = a.prefill(IDS[:5])
    lb = b.prefill(IDS[:2])
    la2 = a.step(IDS[5])
    lb2 = b.step(IDS[2])
    assert (a.position, b.position) == (6, 3)
    assert (a.trace.positions, b.trace.positions) == (6, 3)
    assert len(a.trace.step_seconds) == len(b.trace.step_seconds) == 2
    assert a.trace.executed_layers == b.trace.executed_layers == [0, 1, 2, 3]
    assert a.last_hidden.shape == b.last_hidden.shape == (1, c.graph.hidden_size)
    # interleaving changed nothing: each equals a stream that ran alone
    solo_a, solo_b = ex.start(), ex.start()
    assert np.array_equal(solo_a.prefill(IDS[:5]), la) and np.array_equal(solo_a.step(IDS[5]), la2)
    assert np.array_equal(solo_b.prefill(IDS[:2]), lb) and np.array_equal(solo_b.step(IDS[2]), lb2)
    # the one-shot use: forward, then the executor's trace is that forward's
    ex.forward(IDS)
    assert ex.trace.positions == len(IDS) and ex.trace.executed_layers == [0, 1, 2, 3]


def test_a_layer_range_runs_a_hidden_stream_with_its_own_state(tiny_llama_container):
    c = vindex3.open(tiny_llama_container)
    full = c.executor().start()
    emb = c.segments["embedding"].tensor("weight")
    lo, hi = (c.executor(slice=vindex3.LayerRange(a, b)).start() for a, b in ((0, 1), (1, 4)))
    full.prefill(IDS[:6])
    assert np.array_equal(hi.prefill_hidden(lo.prefill_hidden(emb[IDS[:6]])), full.last_hidden)
    for t in IDS[6:8]:
        full.step(t)
        assert np.array_equal(hi.step_hidden(lo.step_hidden(emb[[t]])), full.last_hidden)
    assert lo.position == hi.position == full.position == 8
    assert hi.trace.executed_layers == [1, 2, 3] and lo.trace.executed_layers == [0]
    with pytest.raises(vindex3.errors.SliceError, match="one position"):
        lo.step_hidden(emb[IDS[:2]])


# ---- weights that know their encoding; one representation per object -------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_an_unknown_encoding_is_carried_and_refused_only_at_preparation(tiny_llama_container, tmp_path):
    """A hand-written 'iq2_xxs' tensor opens (STATS needs no decoding) and is refused by name only
    when an executor must decode it; a draft that never reads it runs."""
    from vindex3.segments import Segment

    c = _copy(tiny_llama_container, tmp_path / "c")
    seg = c / "segments" / "decoder_stack.bin"
    raw = seg.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])
    entry = next(t for t in header["tensors"] if t["name"] == "3.mlp.down_proj.weight")
    entry["dtype"] = "iq2_xxs"
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= hlen
    seg.write_bytes(raw[:8] + text + b" " * (hlen - len(text)) + raw[8 + hlen:])
    assert Segment(seg).entries["3.mlp.down_proj.weight"].dtype == "iq2_xxs"
    reseal(c)  # a hand-written segment: the index records its hashes
    opened = vindex3.open(c)
    assert "iq2_xxs" in {r.dtype for lo in opened.op_plan().layers for r in lo.operands()}
    with pytest.raises(UnsupportedEncoding, match=r"representation decoder_stack@f32 of object decoder_stack has encoding 'iq2_xxs', "
                       r"which this build cannot execute .*its tensor 3\.mlp\.down_proj\.weight"):
        opened.executor()
    assert opened.executor(slice=vindex3.Draft(3)).forward(IDS).shape == (len(IDS), VOCAB)


def test_a_second_representation_of_an_object_is_refused(tiny_llama_container, tmp_path):
    c = _copy(tiny_llama_container, tmp_path / "c")
    index = json.loads((c / "index.json").read_text())
    index["representations"]["embedding@f16"] = dict(index["representations"]["embedding@f32"], encoding="f16")
    (c / "index.json").write_text(json.dumps(index))
    with pytest.raises(IntegrityError, match="object 'embedding' has two representations"):
        vindex3.open(c)


# ---- typed parameters: absence is an error -----------------------------------------------------


@pytest.mark.parametrize("family, path, needle", [
    ("llama", ("norms", "weight_offset"), "surface.norms.weight_offset is missing"),
    ("llama", ("residual", "multiplier"), "surface.residual.multiplier is missing"),
    ("llama", ("head", "multiplier"), "surface.head.multiplier is missing"),
    ("llama", ("ffn", "fused_gate_up"), "'fused_gate_up' is missing"),
    ("mamba2", ("operators", "mamba2", "use_conv_bias"), "'use_conv_bias' is missing"),
    ("mamba2", ("operators", "mamba2", "in_proj_dim"), "'in_proj_dim' is missing"),
])
def test_a_missing_graph_fact_is_refused_by_name_not_defaulted(containers, tmp_path, family, path, needle):
    c = _copy(containers(family), tmp_path / "c")
    g = json.loads((c / "system_graph.json").read_text())
    node = g["surface"]
    for k in path[:-1]:
        node = node[k]
    del node[path[-1]]
    (c / "system_graph.json").write_text(json.dumps(g))
    with pytest.raises(GraphSchemaError, match=needle.replace("(", r"\(")):
        vindex3.open(c)


def test_an_operand_role_the_operator_does_not_have_is_a_closure_defect(containers, tmp_path):
    c = _copy(containers("mamba2"), tmp_path / "c")
    g = json.loads((c / "system_graph.json").read_text())
    g["layers"][0]["operands"]["q_proj"] = g["layers"][0]["operands"]["in_proj"]
    (c / "system_graph.json").write_text(json.dumps(g))
    with pytest.raises(ClosureError, match="role q_proj is not an operand of this layer"):
        vindex3.open(c)
