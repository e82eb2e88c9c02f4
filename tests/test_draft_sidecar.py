"""Dump files and every refusal of SCORE DRAFT, on hand-written sidecars (no container needed)."""

import json

import numpy as np
import pytest

from vindex3.draft.dumps import read_dump, sidecar_path, write_dump
from vindex3.draft.score import score_arrays, score_files
from vindex3.errors import IntegrityError, SliceError

LAYERS = 4
IDS = [5, 1, 7, 3]
VOCAB = 11


def meta(**over):
    m = {
        "format": "vindex3-logit-dump", "format_version": 1, "engine": "vindex3", "backend": "numpy",
        "library_version": "0.1.0", "container_digest": "ab" * 32, "component": "text",
        "draft_depth": None, "executed_layers": list(range(LAYERS)), "model_layers": LAYERS,
        "token_ids": list(IDS), "positions": len(IDS), "vocab": VOCAB, "prepare_seconds": 0.01,
        "step_seconds": 0.02, "ms_per_position": 5.0, "numpy": np.__version__, "blas": {},
        "thread_count": 1,
    }
    m.update(over)
    return m


def logits(seed):
    return np.random.default_rng(seed).standard_normal((len(IDS), VOCAB)).astype(np.float32)


@pytest.fixture
def pair(tmp_path):
    """A valid target (full) and draft (depth 2) pair; returns their paths and arrays."""
    t, d = logits(1), logits(2)
    tp, dp = tmp_path / "target.f32", tmp_path / "draft.f32"
    write_dump(tp, t, meta())
    write_dump(dp, d, meta(draft_depth=2, executed_layers=[0, 1]))
    return dp, tp, d, t


def rewrite(path, **over):
    side = sidecar_path(path)
    m = json.loads(side.read_text())
    m.update(over)
    for k, v in over.items():
        if v is _DROP:
            del m[k]
    side.write_text(json.dumps(m))


_DROP = object()


def test_sidecar_sits_beside_the_data_with_suffix_meta_json(tmp_path):
    assert sidecar_path(tmp_path / "file.f32") == tmp_path / "file.meta.json"


def test_dump_round_trips_bytes_little_endian(pair):
    dp, _, d, _ = pair
    raw = dp.read_bytes()
    assert raw == d.astype("<f4").tobytes()
    m, back = read_dump(dp)
    assert np.array_equal(back, d) and m["data_bytes"] == d.size * 4


def test_valid_pair_scores_as_the_arrays_do(pair):
    dp, tp, d, t = pair
    rep = score_files(dp, tp)
    direct = score_arrays(d, t, IDS)
    assert rep.summary == direct.summary
    assert rep.draft_depth == 2 and rep.draft_executed_layers == [0, 1]
    assert rep.token_ids == IDS and rep.vocab == VOCAB


def test_full_against_itself_is_exact(pair):
    _, tp, _, _ = pair
    rep = score_files(tp, tp)
    assert rep.summary.top1 == 1.0 and rep.summary.kl_max == 0.0


def test_writing_removes_a_stale_sidecar_first(tmp_path, monkeypatch):
    p = tmp_path / "x.f32"
    write_dump(p, logits(1), meta())
    # Fail between data and sidecar: the old sidecar must not survive to vouch for new data.
    from vindex3.draft import dumps

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(dumps.jsonio, "write_atomic", boom)
    with pytest.raises(OSError):
        write_dump(p, logits(2), meta(), overwrite=True)
    assert p.exists() and not sidecar_path(p).exists()
    with pytest.raises(IntegrityError, match="no sidecar x.meta.json"):
        read_dump(p)


def test_refuses_a_missing_sidecar(pair):
    dp, tp, _, _ = pair
    sidecar_path(dp).unlink()
    with pytest.raises(IntegrityError, match="draft.f32: no sidecar draft.meta.json"):
        score_files(dp, tp)


@pytest.mark.parametrize(
    "field, draft_value, needle",
    [
        ("container_digest", "cd" * 32, "container digest"),
        ("component", "other", "component"),
        ("token_ids", [5, 1, 8, 3], r"token ids \(lengths 4 and 4, first difference at index 2\)"),
        ("positions", 3, "positions"),
        ("vocab", 12, "vocab"),
        ("model_layers", 5, "model layers"),
    ],
)
def test_refuses_sidecars_that_disagree(pair, field, draft_value, needle):
    dp, tp, _, _ = pair
    rewrite(dp, **{field: draft_value})
    with pytest.raises(IntegrityError, match=f"differ in {needle}"):
        score_files(dp, tp)


def test_refuses_a_target_that_is_a_draft(pair):
    dp, tp, _, _ = pair
    rewrite(tp, draft_depth=3, executed_layers=[0, 1, 2])
    with pytest.raises(SliceError, match="target is not full depth.*draft_depth=3.*executed 3 of 4"):
        score_files(dp, tp)


def test_refuses_a_target_that_skipped_a_layer(pair):
    dp, tp, _, _ = pair
    rewrite(tp, executed_layers=[0, 1, 3])
    with pytest.raises(SliceError, match="target is not full depth"):
        score_files(dp, tp)


def test_refuses_a_draft_whose_layers_are_not_a_prefix(pair):
    dp, tp, _, _ = pair
    rewrite(dp, executed_layers=[0, 2])
    with pytest.raises(SliceError, match=r"declares depth 2 but executed layers \[0, 2\], not exactly \[0, 2\)"):
        score_files(dp, tp)


def test_refuses_a_draft_that_ran_too_many_layers(pair):
    dp, tp, _, _ = pair
    rewrite(dp, executed_layers=[0, 1, 2])
    with pytest.raises(SliceError, match=r"not exactly \[0, 2\)"):
        score_files(dp, tp)


@pytest.mark.parametrize("depth", [0, 5, "2"])
def test_refuses_a_draft_depth_outside_the_model(pair, depth):
    dp, tp, _, _ = pair
    rewrite(dp, draft_depth=depth)
    with pytest.raises(SliceError, match="is not within 1..4"):
        score_files(dp, tp)


def test_refuses_data_that_does_not_match_its_hash(pair):
    dp, tp, _, _ = pair
    raw = bytearray(dp.read_bytes())
    raw[17] ^= 0x01
    dp.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="draft.f32: data SHA-256 .* differs"):
        score_files(dp, tp)


def test_refuses_truncated_data(pair):
    dp, tp, _, _ = pair
    dp.write_bytes(dp.read_bytes()[:-4])
    with pytest.raises(IntegrityError, match=r"draft.f32: 172 bytes, but the sidecar declares 4 positions × 11 vocab"):
        score_files(dp, tp)


def test_refuses_missing_data(pair):
    dp, tp, _, _ = pair
    tp.unlink()
    with pytest.raises(IntegrityError, match="target.f32: the data file named by target.meta.json is missing"):
        score_files(dp, tp)


@pytest.mark.parametrize(
    "over, needle",
    [
        ({"format": "something"}, "not a logit-dump sidecar"),
        ({"format_version": 2}, "format version 2; this build reads version 1"),
        ({"container_digest": _DROP, "vocab": _DROP}, "sidecar lacks container_digest, vocab"),
    ],
)
def test_refuses_foreign_or_partial_sidecars(pair, over, needle):
    dp, tp, _, _ = pair
    rewrite(dp, **over)
    with pytest.raises(IntegrityError, match=needle):
        score_files(dp, tp)


def test_refuses_an_unreadable_sidecar(pair):
    dp, tp, _, _ = pair
    sidecar_path(dp).write_text("{not json")
    with pytest.raises(IntegrityError, match="draft.meta.json: unreadable sidecar"):
        score_files(dp, tp)
