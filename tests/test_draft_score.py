"""The scoring math on hand-made logit arrays whose answers are derived by hand."""

import math
import re

import numpy as np
import pytest

from vindex3.draft.score import PositionScore, score_arrays, summarize
from vindex3.errors import IntegrityError


def f32(rows):
    return np.asarray(rows, dtype=np.float32)


def test_identical_logits_score_exactly_zero_kl_and_full_agreement():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 50)).astype(np.float32) * 4
    s = score_arrays(x, x.copy(), list(range(7)))
    assert all(p.kl == 0.0 for p in s.positions)
    assert s.summary.kl_max == 0.0 and s.summary.kl_p99 == 0.0
    assert s.summary.top1 == 1.0 and s.summary.top5 == 1.0 and s.summary.top20 == 1.0
    assert s.summary.median_target_rank == 0.0
    # Draft and target are the same model, so the true token sits at the same rank in both.
    assert all(p.next_rank_draft == p.next_rank_target for p in s.positions[:-1])


def test_kl_uniform_target_against_skewed_draft():
    # p_t = (1/3, 1/3, 1/3); p_d = (1/2, 1/4, 1/4)
    # KL = 1/3·ln(2/3) + 2/3·ln(4/3) = (5/3)·ln 2 − ln 3
    target = f32([[0.0, 0.0, 0.0]])
    draft = f32([[math.log(2.0), 0.0, 0.0]])
    s = score_arrays(draft, target, [0])
    assert s.positions[0].kl == pytest.approx(5 / 3 * math.log(2) - math.log(3), abs=1e-7)


def test_kl_direction_is_target_to_draft():
    # p_t = (3/4, 1/4), p_d = (1/2, 1/2): KL(t‖d) = 3/4·ln 3 − ln 2, while KL(d‖t) = ln 2 − ½·ln 3.
    target = f32([[math.log(3.0), 0.0]])
    draft = f32([[0.0, 0.0]])
    kl = score_arrays(draft, target, [1]).positions[0].kl
    assert kl == pytest.approx(0.75 * math.log(3) - math.log(2), abs=1e-7)
    assert kl != pytest.approx(math.log(2) - 0.5 * math.log(3), abs=1e-4)


def test_kl_is_shift_invariant_and_safe_at_large_logits():
    # Max subtraction: adding a constant to a row changes nothing, even one that would overflow exp.
    target = f32([[3.0, 1.0, 0.0, -2.0]])
    draft = f32([[1.0, 2.0, 0.5, 0.0]])
    base = score_arrays(draft, target, [0]).positions[0].kl
    shifted = score_arrays(draft + 1000.0, target - 500.0, [0]).positions[0].kl
    assert math.isfinite(base) and base > 0
    assert shifted == pytest.approx(base, abs=1e-6)


def test_zero_probability_target_token_contributes_nothing():
    # p_t = (1, 0), p_d = (1/2, 1/2): KL = ln 2, and the -inf logit yields no NaN.
    s = score_arrays(f32([[0.0, 0.0]]), f32([[0.0, -np.inf]]), [0])
    assert s.positions[0].kl == pytest.approx(math.log(2), abs=1e-12)


def test_draft_excluding_a_target_token_gives_infinite_kl():
    s = score_arrays(f32([[0.0, -np.inf]]), f32([[0.0, 0.0]]), [0])
    assert s.positions[0].kl == math.inf


def test_rank_counts_strictly_greater_and_ties_do_not_push_down():
    target = f32([[0, 0, 9, 0, 0, 0]])  # argmax 2
    draft = f32([[5, 7, 3, 7, 1, 3]])  # 5, 7, 7 exceed 3; the other 3 ties and does not count
    p = score_arrays(draft, target, [4]).positions[0]
    assert p.target_argmax == 2 and p.draft_argmax == 1
    assert p.top1 is False
    assert p.target_rank_in_draft == 3
    assert p.in_top5 is True and p.in_top20 is True


@pytest.mark.parametrize(
    "argmax, rank, top5, top20",
    [(29, 0, True, True), (25, 4, True, True), (24, 5, False, True), (10, 19, False, True),
     (9, 20, False, False), (0, 29, False, False)],
)
def test_top5_top20_containment_boundaries(argmax, rank, top5, top20):
    draft = f32([np.arange(30)])  # draft logit of token v is v: rank of v is 29 - v
    row = np.zeros(30, np.float32)
    row[argmax] = 1.0
    p = score_arrays(draft, f32([row]), [0]).positions[0]
    assert (p.target_rank_in_draft, p.in_top5, p.in_top20) == (rank, top5, top20)


def test_true_next_token_rank_in_draft_and_target():
    # Row i predicts token i+1: rows 0 and 1 are checked against tokens 3 and 0; row 2 has none.
    draft = f32([[4, 3, 2, 1], [1, 2, 3, 4], [0, 0, 0, 0]])
    target = f32([[1, 2, 3, 4], [4, 3, 2, 1], [0, 0, 0, 0]])
    s = score_arrays(draft, target, [2, 3, 0])
    p0, p1, p2 = s.positions
    assert (p0.next_token, p0.next_rank_draft, p0.next_rank_target) == (3, 3, 0)
    assert (p1.next_token, p1.next_rank_draft, p1.next_rank_target) == (0, 3, 0)
    assert (p2.next_token, p2.next_rank_draft, p2.next_rank_target) == (None, None, None)
    assert s.summary.next_positions == 2
    assert s.summary.median_next_rank_draft == 3.0 and s.summary.median_next_rank_target == 0.0
    # Target argmax sits at rank 3 in the draft on rows 0 and 1; row 2 is all ties (rank 0).
    assert [p.target_rank_in_draft for p in s.positions] == [3, 3, 0]
    assert s.summary.top1 == pytest.approx(1 / 3)
    assert s.summary.median_target_rank == 3.0


def test_single_position_has_no_next_token_summary():
    s = score_arrays(f32([[1, 0]]), f32([[1, 0]]), [0])
    assert s.summary.next_positions == 0
    assert s.summary.median_next_rank_draft is None and s.summary.median_next_rank_target is None


def _pos(i, kl, top1=True, rank=0):
    return PositionScore(position=i, kl=kl, top1=top1, target_argmax=0, draft_argmax=0,
                         target_rank_in_draft=rank, in_top5=rank < 5, in_top20=rank < 20)


def test_summary_percentiles_use_linear_interpolation():
    s = summarize([_pos(i, float(i)) for i in range(100)])  # KL = 0..99
    assert s.kl_mean == 49.5 and s.kl_p50 == 49.5
    assert s.kl_p90 == pytest.approx(89.1) and s.kl_p99 == pytest.approx(98.01)
    assert s.kl_max == 99.0


@pytest.mark.parametrize("n", [1, 2, 7, 100, 101])
def test_summary_percentiles_agree_with_numpy_on_finite_values(n):
    kl = np.random.default_rng(n).exponential(size=n)
    s = summarize([_pos(i, float(v)) for i, v in enumerate(kl)])
    assert [s.kl_p50, s.kl_p90, s.kl_p99] == pytest.approx(np.percentile(kl, [50, 90, 99]).tolist(), abs=1e-12)


def test_an_infinite_kl_makes_upper_percentiles_infinite_not_nan():
    only = summarize([_pos(0, math.inf)])
    assert only.kl_p50 == only.kl_p99 == only.kl_mean == only.kl_max == math.inf
    mixed = summarize([_pos(i, float(i)) for i in range(9)] + [_pos(9, math.inf)])  # KL 0..8, inf
    assert mixed.kl_p50 == 4.5
    assert mixed.kl_p90 == math.inf and mixed.kl_p99 == math.inf


def test_summary_rates_and_median_rank():
    ps = [_pos(0, 0.0, True, 0), _pos(1, 0.0, False, 3), _pos(2, 0.0, False, 7), _pos(3, 0.0, False, 30)]
    s = summarize(ps)
    assert s.top1 == 0.25
    assert s.top5 == 0.5 and s.top20 == 0.75
    assert s.median_target_rank == 5.0  # median of 0, 3, 7, 30


def test_summary_of_nothing_is_refused():
    with pytest.raises(IntegrityError, match="no positions"):
        summarize([])


@pytest.mark.parametrize(
    "draft, target, ids, needle",
    [
        (np.zeros((2, 4)), np.zeros((2, 5)), [0, 1], "differ in shape"),
        (np.zeros((2, 4)), np.zeros((2, 4)), [0, 1, 2], "3 token ids"),
        (np.zeros((2, 4)), np.zeros((2, 4)), [0, 4], "outside the vocabulary of 4"),
        (np.zeros(4), np.zeros(4), [0], "2-D"),
        (np.array([[0, np.nan]]), np.zeros((1, 2)), [0], "draft logits hold NaN or +inf at positions [0]"),
        (np.zeros((2, 2)), np.array([[0, 0], [np.inf, 0]]), [0, 1], "target logits hold NaN or +inf at positions [1]"),
    ],
)
def test_score_arrays_refuses_malformed_input(draft, target, ids, needle):
    with pytest.raises(IntegrityError, match=re.escape(needle)):
        score_arrays(np.asarray(draft, np.float32), np.asarray(target, np.float32), ids)
