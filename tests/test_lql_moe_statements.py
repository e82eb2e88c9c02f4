"""LQL on routed-expert models: SHOW EXPERTS (the expert banks, from the plan), TRACE ...
EXPERTS (the routing of a prompt, position by position, with the bytes each step read), what
STATS, EXPLAIN and INFER say about expert-bank reads, SHOW PROVENANCE's summary of the assembled
banks, the refusals, JSON, the server's read-only profile and the REPL's completion.

Rendered text is held in lql_cases/moe.txt (format: lql_fixtures.py) on the tiny qwen3_moe
fixture; the figures are checked here against sizes computed from the tensor shapes and against
vindex3's own trace, independently of the LQL code."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from lql_fixtures import HERE, check_case, read_cases, run_case

import lql
from lql.errors import StatementError
from lql.statements.facts import provenance_value

CASES_FILE = HERE / "lql_cases" / "moe.txt"
CASES = read_cases(CASES_FILE)
IDS = [1, 5, 17, 99, 3, 250, 42, 7]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_statement_renders(case, containers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    container = containers("qwen3_moe")
    got = run_case(case.text.replace("<container>", str(container)), container, tmp_path)
    check_case(case, got, CASES_FILE)


def test_case_names_are_unique():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


# -- a DeepSeek-V3 with routed experts (sigmoid group-limited router), built here ------------------

DS = {"vocab_size": 320, "hidden_size": 40, "num_hidden_layers": 3, "num_attention_heads": 3, "num_key_value_heads": 3,
      "q_lora_rank": None, "kv_lora_rank": 18, "qk_rope_head_dim": 6, "qk_nope_head_dim": 10, "v_head_dim": 14,
      "intermediate_size": 56, "moe_intermediate_size": 23, "first_k_dense_replace": 1, "n_routed_experts": 12,
      "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 2, "rope_interleave": False,
      "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}, "max_position_embeddings": 256,
      "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    torch = pytest.importorskip("torch", reason="SKIPPED LOUDLY: torch builds the DeepSeek fixture")
    transformers = pytest.importorskip("transformers", reason="SKIPPED LOUDLY: transformers builds the fixture")
    from fixtures import build_tokenizer

    import vindex3

    out = tmp_path_factory.mktemp("ds") / "ck"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**DS), dtype=torch.float32)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            fan = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan) if p.dim() > 1 else 1 + 0.3 * torch.randn(
                p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(out)
    build_tokenizer(out)
    return vindex3.encode(out, out.parent / "ds.vindex3")


def _session(path) -> lql.Session:
    s = lql.Session()
    s.execute(f"OPEN '{path}'")
    return s


def _one(s: lql.Session, text: str):
    (r,) = s.execute(text)
    return r


# -- SHOW EXPERTS: sizes from the tensor shapes ------------------------------------------------------


def test_show_experts_figures_follow_the_shapes(containers, deepseek):
    E, k, H, In = 10, 3, 45, 23  # the qwen3_moe fixture: no shared expert
    r = _one(_session(containers("qwen3_moe")), "SHOW EXPERTS")
    assert [b.layer for b in r.banks] == [0, 2]
    for b in r.banks:
        assert (b.experts, b.top_k, b.router, b.expert_width, b.shared) == (E, k, "softmax_topk", In, "none")
        assert b.router_facts["renormalize"] is True and b.router_facts["n_group"] is None
        assert b.bytes_per_expert == 3 * H * In * 4 and b.expert_bank_bytes == E * b.bytes_per_expert
        assert b.always_bytes == E * H * 4  # the router
        assert b.bytes_per_position == b.always_bytes + k * b.bytes_per_expert
    x = r.reads
    assert x.expert_layers == [0, 2] and x.expert_bank_bytes == 2 * E * 3 * H * In * 4
    assert x.always_bytes + x.expert_bank_bytes + x.embedding_bytes == x.total_bytes
    assert x.per_position_bytes == x.always_bytes + 2 * k * 3 * H * In * 4 + H * 4  # and one embedding row

    E, k, H, In, S = 12, 3, 40, 23, 46  # DeepSeek: correction bias, two shared experts
    r = _one(_session(deepseek), "SHOW EXPERTS AT LAYER 2")
    (b,) = r.banks
    assert (b.layer, b.experts, b.top_k, b.router, b.shared, b.shared_width) == (2, E, k, "sigmoid_group_topk", "plain", S)
    assert b.router_facts == {"renormalize": True, "router_bias": False, "correction_bias": True, "n_group": 4,
                              "topk_group": 2, "routed_scaling_factor": 2.5}
    assert b.always_bytes == (E * H + E + 3 * H * S) * 4  # router, correction bias, shared MLP
    assert b.bytes_per_position == b.always_bytes + k * 3 * H * In * 4
    text = r.to_text()
    assert "sigmoid_group_topk, 2 of 4 groups, correction bias, renormalised, x2.5" in text
    assert "plain 46" in text


def test_show_experts_refuses_what_has_no_experts(containers, tiny_llama_container):
    s = _session(tiny_llama_container)
    with pytest.raises(StatementError, match="SHOW EXPERTS needs routed-expert layers, and model llama has none"):
        s.execute("SHOW EXPERTS")
    with pytest.raises(StatementError, match="TRACE ... EXPERTS needs routed-expert layers"):
        s.execute("TRACE 'x' EXPERTS")
    assert "reads per position" not in _one(s, "STATS").to_text()  # nothing to split: no section
    assert _one(s, "STATS").reads.expert_bank_bytes == 0
    m = _session(containers("qwen3_moe"))
    with pytest.raises(StatementError, match="layer 1 has no routed experts; the routed layers are 0, 2"):
        m.execute("TRACE TOKENS (1, 2) EXPERTS AT LAYER 1")
    with pytest.raises(StatementError, match="layer 3 does not exist"):
        m.execute("SHOW EXPERTS AT LAYER 3")


# -- TRACE ... EXPERTS: the routing vindex3 records ----------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek"])
def test_trace_experts_is_the_recorded_routing(containers, deepseek, family):
    """Every position's experts and weights equal what vindex3's stream trace records for the
    same token-by-token run, the prefill's routing agrees (same experts, weights within float32
    rounding), and every position's bytes are one position's reads: always + k experts of E."""
    import vindex3
    from vindex3.operators.moe_ffn import expert_routing, routing_from_trace

    path = containers(family) if family != "deepseek" else deepseek
    s = _session(path)
    toks = ", ".join(map(str, IDS))
    r = _one(s, f"TRACE TOKENS ({toks}) EXPERTS")
    c = vindex3.open(path)
    ex = c.executor()
    st = ex.start()
    for t in IDS:
        st.step(t)
    want = routing_from_trace(st.trace, ex.plan)
    assert [x.layer for x in r.expert_layers] == [lr.layer for lr in want]
    for lr in want:
        for p in lr.positions:
            (pick,) = [x for x in r.rows[p.position].experts if x.layer == lr.layer]
            assert pick.experts == p.experts and pick.weights == p.weights
    pre = expert_routing(c, IDS)
    for lr in pre.layers:
        for p in lr.positions:
            (pick,) = [x for x in r.rows[p.position].experts if x.layer == lr.layer]
            assert pick.experts == p.experts
            # decode vs prefill weights: 3.6e-7 apart here, 2% of the bound; the reference routers' own
            # fp32-vs-fp64 spread on the MoE model fixtures is at most 4.5e-6, a third of it
            assert np.allclose(pick.weights, p.weights, atol=1e-5)
    per_position = c.op_plan().read_profile().per_position_bytes
    assert [row.bytes_read for row in r.rows] == [per_position] * len(IDS) == st.trace.step_bytes
    # usable from JSON: one object, positions -> layers -> experts and weights
    obj = json.loads(r.to_json())
    rows = obj["result"]["rows"]
    assert rows[3]["experts"][0] == {"layer": want[0].layer, "experts": want[0].positions[3].experts,
                                     "weights": want[0].positions[3].weights}
    assert obj["result"]["expert_layers"][0]["top_k"] == want[0].top_k
    recs = r.to_records()
    assert len(recs) == len(IDS) and recs[0]["bytes_read"] == per_position


def test_infer_reports_the_bytes_each_step_read(containers):
    s = _session(containers("qwen3_moe"))
    r = _one(s, "INFER TOKENS (1, 5, 17, 99) GENERATE 5 EXACTLY")
    per_position = s.container.op_plan().read_profile().per_position_bytes
    assert r.expert_layers == [0, 2]
    assert r.decode_bytes == [per_position] * 4  # the fifth token is not run
    assert per_position < r.prefill_bytes <= s.container.op_plan().read_profile().total_bytes
    assert "per decode step  " + f"{per_position:,} bytes (mean of 4" in r.to_text()
    d = _one(s, "INFER TOKENS (1, 5) TOP 2 DRAFT DEPTH 1")
    assert d.expert_layers == [0] and d.decode_bytes == []


def test_explain_shows_each_routed_op_and_the_bytes_per_token(containers):
    s = _session(containers("qwen3_moe"))
    r = _one(s, "EXPLAIN")
    routed = [st for st in r.steps if st.stage == "layer" and "ffn" in (st.reads or {}).get("detail", {})]
    assert [st.layer for st in routed] == [0, 2]
    d = routed[0].reads["detail"]["ffn"]
    assert (d["operator"], d["experts"], d["top_k"], d["router"]) == ("moe_ffn", 10, 3, "softmax_topk")
    text = r.to_text()
    assert text.count("ffn moe_ffn: top 3 of 10 experts (softmax_topk); a token reads 39,060 bytes") == 2
    assert r.per_position.per_position_bytes == s.container.op_plan().read_profile().per_position_bytes
    assert "per position (a token reads)" in text


def test_provenance_summarises_assembled_banks_and_json_keeps_them(containers):
    r = _one(_session(containers("qwen3_moe")), "SHOW PROVENANCE")
    assembled = r.provenance["assembled_tensors"]
    assert len(assembled) == 4 and sum(len(a["sources"]) for a in assembled) == 60  # 2 layers x (20 + 10)
    text = r.to_text()
    line = next(x for x in text.splitlines() if x.startswith("assembled_tensors"))
    assert "4 tensors from 60 source tensors" in line and "experts.0." not in text
    assert json.loads(r.to_json())["result"]["provenance"]["assembled_tensors"] == assembled


def test_summaries_of_long_dropped_lists():
    rows = [{"tensor": f"model.visual.blocks.{i}.w", "why": "vision tower (perception), not carried"} for i in range(20)]
    got = provenance_value("dropped_tensors", rows)
    assert got.startswith("20 tensors (20: vision tower (perception), not carried")
    assert provenance_value("dropped_tensors", rows[:2]).startswith("[{tensor: model.visual")


# -- serving, completion --------------------------------------------------------------------------


def test_the_read_only_profile_serves_the_expert_statements(tmp_path):
    from lql import parser
    from lql.server.config import ModelSpec, ServerConfig
    from lql.server.policy import check_statement

    cfg = ServerConfig(models=(ModelSpec("m", tmp_path),), profile="read-only")
    for text in ("SHOW EXPERTS", "SHOW EXPERTS AT LAYER 0", "TRACE 'x' EXPERTS AT LAYER 0"):
        stmt = parser.parse_one(text)
        assert check_statement(stmt, cfg) is stmt


def test_completion_offers_experts_from_the_grammar():
    from prompt_toolkit.completion import CompleteEvent
    from prompt_toolkit.document import Document

    from lql.repl_complete import LqlCompleter

    comp = LqlCompleter(settings=list, meta_commands=[])

    def texts(t):
        return [c.text for c in comp.get_completions(Document(t), CompleteEvent(completion_requested=True))]

    assert "EXPERTS" in texts("SHOW ")
    assert "EXPERTS" in texts("TRACE 'x' ") and "EXPERTS" in texts("TRACE 'x' DRAFT DEPTH 1 ")
    assert texts("SHOW EXPERTS ") == ["AT"] and texts("TRACE 'x' EXPERTS AT ") == ["LAYER"]
