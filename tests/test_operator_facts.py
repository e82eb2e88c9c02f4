"""Operator facts are declared once: each recurrent or latent operator has one params type that
its kernels take (the kernel-level "geometry" names build that very type), one state class, and
its operands declared once (closure's roles, the kernel's operand record and its checks)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vindex3.codecs.f32 import DenseF32
from vindex3.errors import ClosureError, GraphSchemaError, StateError, UnsupportedOperator
from vindex3.exec.ops import gated_delta as gd_k
from vindex3.exec.ops import kda as kda_k
from vindex3.exec.ops import mamba2 as m2_k
from vindex3.exec.ops import mla as mla_k
from vindex3.exec.ops.checks import check_buffers, check_input
from vindex3.exec.state import RecurrentState
from vindex3.operators import gated_delta as gd_op
from vindex3.operators import get
from vindex3.operators import kda as kda_op
from vindex3.operators import mamba2 as m2_op
from vindex3.operators import mla as mla_op
from vindex3.operators.base import DataParams, RoleSpec, check_operands, parse_params

KDA = {"hidden_size": 16, "num_heads": 2, "head_dim": 4, "conv_kernel": 3, "forget_rank": 3, "gate_rank": 5, "chunk_size": 8,
           "norm_eps": 1e-5, "l2norm_eps": 1e-6, "conv_activation": "silu"}
MAMBA2 = {"hidden_size": 12, "num_heads": 4, "head_dim": 3, "state_size": 5, "n_groups": 2, "conv_kernel": 3, "chunk_size": 8,
              "time_step_limit": (0.0, float("inf")), "norm_eps": 1e-5, "use_conv_bias": True, "use_bias": False}
GDN = {"hidden_size": 12, "num_key_heads": 2, "num_value_heads": 4, "key_head_dim": 3, "value_head_dim": 5, "conv_kernel": 4,
           "chunk_size": 8, "norm_eps": 1e-6, "qk_l2norm_eps": 1e-6, "projection_layout": "qkv_z_b_a", "conv_activation": "silu"}
MLA = {"hidden_size": 16, "num_heads": 2, "q_lora_rank": 6, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2,
           "v_head_dim": 5, "q_a_norm_eps": 1e-6, "kv_a_norm_eps": 1e-6, "attention_bias": False, "rope": None}

CASES = [  # operator, kernel-level constructor, its facts, params, state, operand record
    ("kda", kda_k.KdaGeometry, KDA, kda_op.KdaParams, kda_op.KdaState, kda_k.KdaWeights),
    ("mamba2", m2_k.Mamba2Geometry, MAMBA2, m2_op.Mamba2Params, m2_op.Mamba2State, m2_k.Mamba2Weights),
    ("gated_delta", gd_k.GatedDeltaGeometry, GDN, gd_op.GatedDeltaParams, gd_op.GatedDeltaState,
     gd_k.GatedDeltaWeights),
]


@pytest.mark.parametrize("name, make, facts, params, state, weights", CASES)
def test_one_params_type_one_state_class_one_operand_list(name, make, facts, params, state, weights):
    p = make(**facts)
    assert type(p) is params and isinstance(p, DataParams)
    op = get(name)
    assert op.Params is params
    # the operator's state is the kernels' state, built from the params' own buffer list
    st = op.new_state(p)
    assert type(st) is state and isinstance(st, RecurrentState) and not st.started
    assert [(n, getattr(st, n).shape) for n in state.names] == [(n, s) for n, s, _ in p.buffers()]
    assert [(part.name, part.shape) for part in op.geometry(p).parts] == [(n, s) for n, s, _ in p.buffers()]
    # the kernel's operand record has one field per role, in role order, and nothing else
    module = {"kda": kda_op, "mamba2": m2_op, "gated_delta": gd_op}[name]
    always = [s.attr for s in module.ROLES if s.when is None]
    assert [f.name for f in dataclasses.fields(weights)] == always + [s.attr for s in module.ROLES if s.when is not None]
    assert {r.name for r in op.roles(p)} <= {s.name for s in module.ROLES}
    # replace re-validates: a derived fact can never go stale
    assert dataclasses.replace(p, chunk_size=16).chunk_size == 16
    with pytest.raises(ValueError, match="chunk_size"):
        dataclasses.replace(p, chunk_size=0)


def test_state_buffers_are_positional_or_named_and_copy_carries_started():
    p = kda_k.KdaGeometry(**KDA)
    st = kda_op.KdaState.zeros(p)
    same = kda_op.KdaState(st.recurrent, st.conv_q, st.conv_k, st.conv_v)
    assert same.recurrent is st.recurrent and not same.started
    st.started = True
    c = st.copy()
    c.recurrent[0, 0, 0] = 1.0
    assert c.started and st.recurrent[0, 0, 0] == 0.0
    with pytest.raises(StateError, match="holds 4 buffers"):
        kda_op.KdaState(*([st.recurrent] * 5))


def test_mla_kernels_take_the_judged_params():
    p = mla_k.MlaGeometry(**MLA)
    assert type(p) is mla_op.JudgedMlaParams and isinstance(p, mla_op.MlaParams)
    assert p.softmax_scale == pytest.approx(p.attention_scale, rel=1e-12) and p.judgments == {}
    unjudged = mla_op.MlaParams(**{**dataclasses.asdict(p), "kv_a_norm_eps": None})  # loads: STATS needs no eps
    with pytest.raises(GraphSchemaError, match="kv_a_norm_eps"):
        unjudged.judged()
    assert [r.name for r in get("mla").roles(p) if r.required] == ["q_a_proj", "q_a_norm", "q_b_proj", "kv_a_proj",
                                                                     "kv_a_norm", "kv_b_proj", "o_proj"]
    assert dict(p)["rope"] is None and "judgments" not in dict(p)


def test_graph_refusals_name_the_fact():
    where = "layer 3 (kda)"
    with pytest.raises(GraphSchemaError, match=r"layer 3 \(kda\): 'gate_rank' is missing"):
        parse_params(kda_op.KdaParams, {k: v for k, v in KDA.items() if k != "gate_rank"}, where)
    with pytest.raises(GraphSchemaError, match="'colour' is not a parameter"):
        parse_params(kda_op.KdaParams, {**KDA, "colour": 1}, where)
    with pytest.raises(GraphSchemaError, match="'head_dim' input should be a valid integer"):
        parse_params(kda_op.KdaParams, {**KDA, "head_dim": "4"}, where)
    with pytest.raises(GraphSchemaError, match=r"layer 3 \(kda\): kda conv activation 'gelu' has no executor"):
        parse_params(kda_op.KdaParams, {**KDA, "conv_activation": "gelu"}, where)
    with pytest.raises(UnsupportedOperator, match="gelu"):  # built by a kernel caller: the executor's refusal
        kda_k.KdaGeometry(**{**KDA, "conv_activation": "gelu"})
    with pytest.raises(GraphSchemaError, match="'in_proj_dim' is missing"):
        parse_params(m2_op.Mamba2Params, {k: v for k, v in dataclasses.asdict(m2_k.Mamba2Geometry(**MAMBA2)).items()
                                          if k != "in_proj_dim"}, "layer 0 (mamba2)")


def test_the_shared_checks_name_what_is_wrong():
    spec = (RoleSpec("w", "rows hidden_size"), RoleSpec("conv", "rows 1 k", "array", view="rows k"),
            RoleSpec("bias", "rows", "array", when="biased"))

    @dataclasses.dataclass
    class P:
        rows: int = 3
        hidden_size: int = 4
        k: int = 2
        biased: bool = False

    @dataclasses.dataclass
    class W:
        w: object
        conv: object
        bias: object = None

    ok = W(DenseF32(np.zeros((3, 4), np.float32)), np.zeros((3, 1, 2), np.float32))
    out = check_operands("toy", spec, ok, P())
    assert out["conv"].shape == (3, 2)  # the checkpoint's layout read as the kernel's view
    bad = W(np.zeros((3, 4), np.float32), np.zeros((3, 3), np.float32), np.zeros(3, np.float32))
    with pytest.raises(ClosureError) as e:
        check_operands("toy", spec, bad, P())
    text = str(e.value)
    assert "w: not a weight object with mm()" in text and "conv: shape [3, 3], expected [3, 2]" in text
    assert "bias: present, but the params leave it out (biased is false)" in text
    with pytest.raises(TypeError, match="float32"):
        check_input(np.zeros(4), 1, 4, "toy_step")
    with pytest.raises(ValueError, match="hidden=5"):
        check_input(np.zeros(4, np.float32), 1, 5, "toy_step")

    class S:
        a = np.zeros((2, 2), np.float32)[:, :1]

    with pytest.raises(StateError, match="'a' is float32 \\[2, 1\\]; expected a writable, contiguous float32 \\[2, 1\\]"):
        check_buffers("toy", S(), [("a", (2, 1))], contiguous=True)
