"""A routed layer's router reaches readers as a typed object (`RouterFacts`), never as parameter
names: its phrase is what SHOW EXPERTS prints, and it round-trips through JSON."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from vindex3.operators import get
from vindex3.operators.moe_ffn import MoeFfnParams, RouterFacts

BASE = {"hidden_size": 8, "num_experts": 8, "top_k": 2, "expert_intermediate": 5, "expert_act": "silu", "swiglu_limit": None,
            "swiglu_alpha": None, "gate_up": "separate", "expert_bias": False, "shared": "none", "shared_intermediate": None,
            "shared_act": None, "shared_gate_up": None}
SOFTMAX = {"router": "softmax_topk", "renormalize": True, "router_bias": False, "correction_bias": False, "n_group": None,
               "topk_group": None, "routed_scaling_factor": None}
GROUPED = {"router": "sigmoid_group_topk", "renormalize": True, "router_bias": False, "correction_bias": True, "n_group": 4,
               "topk_group": 2, "routed_scaling_factor": 2.5}


@pytest.mark.parametrize("facts, phrase", [
    (SOFTMAX, "softmax_topk, renormalised"),
    ({**SOFTMAX, "router": "topk_softmax", "renormalize": False, "router_bias": True}, "topk_softmax, bias"),
    (GROUPED, "sigmoid_group_topk, 2 of 4 groups, correction bias, renormalised, x2.5"),
    ({**GROUPED, "renormalize": False, "n_group": 2, "topk_group": 2, "routed_scaling_factor": 1.7},
     "sigmoid_group_topk, 2 of 2 groups, correction bias, x1.7"),
    ({**GROUPED, "routed_scaling_factor": 2.446}, "sigmoid_group_topk, 2 of 4 groups, correction bias, renormalised, x2.446"),
])
def test_the_operator_returns_router_facts_and_their_phrase(facts, phrase):
    p = MoeFfnParams(**BASE, **facts)
    rf = get("moe_ffn").router_facts(p)
    assert isinstance(rf, RouterFacts) and rf.router == facts["router"]
    assert rf.phrase() == phrase
    assert RouterFacts.model_validate_json(rf.model_dump_json()) == rf


def test_router_facts_refuse_unknown_and_missing_facts():
    with pytest.raises(ValidationError, match="extra"):
        RouterFacts(**SOFTMAX, experts=8)
    with pytest.raises(ValidationError, match="n_group"):
        RouterFacts(**{k: v for k, v in SOFTMAX.items() if k != "n_group"})
