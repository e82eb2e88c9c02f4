"""Self-speculative decoding: the output is the full model's greedy continuation, whatever the
draft depth, lookahead and rollback mechanism."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from fixtures import FAMILIES

import vindex3
from vindex3.draft import greedy_generate, speculative_generate
from vindex3.draft import speculative as spec
from vindex3.errors import SliceError, StateError, UnsupportedOperator, VindexError

PROMPT = [1, 5, 9, 33, 100, 7]
N = 24


@pytest.fixture(scope="module")
def c(tiny_llama_container):
    x = tiny_llama_container
    return vindex3.open(x) if isinstance(x, (str, Path)) else x


@pytest.fixture(scope="module")
def greedy(c):
    return greedy_generate(c, PROMPT, N).tokens


def test_plain_greedy_is_prefill_then_argmax_steps(c, greedy):
    st = c.executor().start()
    tok = int(st.prefill(PROMPT)[-1].argmax())
    out = [tok]
    while len(out) < N:
        tok = int(st.step(tok).argmax())
        out.append(tok)
    assert greedy == out


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("lookahead", [1, 3, 5])
def test_speculative_output_equals_greedy(c, greedy, depth, lookahead):
    r = speculative_generate(c, PROMPT, N, depth, lookahead)
    assert r.tokens == greedy
    assert r.rollback == "truncate"
    assert r.n == N and r.depth == depth and r.lookahead == lookahead
    assert sum(r.accepted_histogram) == r.rounds
    assert r.accepted == sum(j * n for j, n in enumerate(r.accepted_histogram))
    assert 0.0 <= r.acceptance_rate <= 1.0
    # Every full-model call emits its accepted drafts plus the model's own pick (the prompt
    # prefill emits one); a call with nothing to verify (the last token) is a plain step.
    assert r.full_model_calls + r.accepted == N
    assert r.full_model_calls >= 1 + r.rounds


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_speculative_output_equals_greedy_on_every_family(containers, family):
    fc = vindex3.open(containers(family))
    want = greedy_generate(fc, PROMPT, N).tokens
    # Families whose layers keep recurrent state (mamba2, hybrids) roll back by snapshot.
    recurrent = any(g.rollback == "snapshot" for g in fc.continuation())
    for depth, lookahead in [(1, 3), (fc.graph.num_layers - 1, 4)]:
        r = speculative_generate(fc, PROMPT, N, depth, lookahead)
        assert r.tokens == want, (depth, lookahead)
        assert r.rollback == ("snapshot" if recurrent else "truncate")


def test_full_depth_draft_is_always_accepted(c, greedy):
    L = c.graph.num_layers
    r = speculative_generate(c, PROMPT, N, L, 4)
    assert r.tokens == greedy
    assert r.acceptance_rate == 1.0
    # 23 tokens after the prefill, in rounds of 4 accepted + 1 own: 5, 5, 5, 5, then 3.
    assert r.rounds == 5 and r.full_model_calls == 6
    assert r.tokens_per_full_step == N / 6


def test_snapshot_rollback_gives_the_same_tokens(c, greedy, monkeypatch):
    # Pretend every layer keeps recurrent state: rollback must go through snapshot/restore and
    # a replay of the accepted tokens, and still reproduce greedy decoding.
    monkeypatch.setattr(spec, "recurrent_layers", lambda cont, executed: [(i, "mamba2") for i in executed])
    r = speculative_generate(c, PROMPT, N, 2, 3)
    assert r.rollback == "snapshot"
    assert r.tokens == greedy
    assert r.full_model_calls >= 1 + r.rounds  # replays count as full-model calls


def test_compare_plain_reports_speed_and_agreement(c, greedy):
    r = speculative_generate(c, PROMPT, N, 2, 2, compare_plain=True)
    assert r.matches_plain is True and r.plain.tokens == greedy
    assert r.speedup == pytest.approx(r.plain.seconds / r.seconds)


def test_on_token_sees_every_token_in_order(c, greedy):
    seen = []
    r = speculative_generate(c, PROMPT, N, 2, 4, on_token=seen.append)
    assert seen == r.tokens == greedy


@pytest.mark.parametrize("n", [0, 1, 2])
def test_short_generations(c, greedy, n):
    r = speculative_generate(c, PROMPT, n, 1, 4)
    assert r.tokens == greedy[:n]


@pytest.mark.parametrize(
    "kwargs, err, needle",
    [
        ({"depth": 0}, SliceError, "smallest draft is depth 1"),
        ({"depth": 99}, SliceError, "deeper than the model"),
        ({"depth": None}, SliceError, "needs a draft depth"),
        ({"lookahead": 0}, VindexError, "LOOKAHEAD must be an integer ≥ 1"),
        ({"n": -1}, VindexError, "GENERATE count must be a non-negative integer"),
    ],
)
def test_impossible_requests_are_refused(c, kwargs, err, needle):
    args = {"token_ids": PROMPT, "n": 4, "depth": 1, "lookahead": 2} | kwargs
    with pytest.raises(err, match=needle):
        speculative_generate(c, **args)


def test_empty_prompt_is_refused(c):
    with pytest.raises(VindexError, match="at least one prompt token"):
        speculative_generate(c, [], 4, 1)


class _RefusingState:
    position = 0

    def snapshot(self):
        raise StateError("layer 1 buffers cannot be copied")

    def restore(self, snap):
        raise AssertionError("unreachable")


def _recurrent_container():
    layers = [SimpleNamespace(operator="softmax", geometry=SimpleNamespace(rollback="truncate")),
              SimpleNamespace(operator="mamba2", geometry=SimpleNamespace(rollback="snapshot"))]
    return SimpleNamespace(
        op_plan=lambda: SimpleNamespace(layers=layers),
        plan_slice=lambda sl: SimpleNamespace(executed_layers=[0, 1]),
    )


@pytest.mark.parametrize("state, reason", [(_RefusingState(), "buffers cannot be copied")])
def test_recurrent_state_without_snapshot_is_refused_by_name(state, reason):
    with pytest.raises(UnsupportedOperator, match=f"layer 1 \\(mamba2\\) keeps recurrent state.*{reason}"):
        spec._rollback_mode(_recurrent_container(), None, state, "full")
