"""Logit dumps from a real (tiny, random) container: sidecar contents, the decode path, and the
invariant that a draft at full depth is the full model, bit for bit."""

from pathlib import Path

import numpy as np
import pytest
from fixtures import FAMILIES

import vindex3
from vindex3.draft import dump_logits, read_dump, score_files, sidecar_path
from vindex3.draft.dumps import REQUIRED_KEYS
from vindex3.errors import SliceError, VindexError

IDS = [1, 5, 9, 33, 100, 7, 7, 12, 3]


@pytest.fixture(scope="module")
def c(tiny_llama_container):
    x = tiny_llama_container
    return vindex3.open(x) if isinstance(x, (str, Path)) else x


@pytest.fixture(scope="module")
def target(c, tmp_path_factory):
    p = tmp_path_factory.mktemp("dumps") / "target.f32"
    return p, dump_logits(c, IDS, vindex3.Full(), p)


def test_sidecar_records_provenance(c, target):
    path, meta = target
    on_disk = read_dump(path)[0]
    assert on_disk == meta
    assert set(REQUIRED_KEYS) <= set(meta)
    L = c.graph.num_layers
    assert meta["engine"] == "vindex3" and meta["backend"] == "numpy"
    assert meta["container_digest"] == c.digest
    assert meta["component"] == c.graph.component.name
    assert meta["draft_depth"] is None
    assert meta["executed_layers"] == list(range(L)) and meta["model_layers"] == L
    assert meta["token_ids"] == IDS and meta["positions"] == len(IDS)
    assert meta["vocab"] == c.op_plan().vocab
    assert meta["prepare_seconds"] > 0 and meta["step_seconds"] > 0
    assert meta["ms_per_position"] == pytest.approx(meta["step_seconds"] * 1000 / len(IDS))
    assert meta["numpy"] == np.__version__
    assert meta["blas"]["name"] and "threads" in meta["blas"]
    assert meta["thread_count"] is None or meta["thread_count"] >= 1
    assert meta["library_version"]
    assert sidecar_path(path).name == "target.meta.json"


def test_draft_sidecar_names_its_depth_and_layers(c, tmp_path):
    meta = dump_logits(c, IDS, vindex3.Draft(2), tmp_path / "d2.f32")
    assert meta["draft_depth"] == 2 and meta["executed_layers"] == [0, 1]
    assert meta["model_layers"] == c.graph.num_layers


def test_rows_come_from_the_decode_path_and_predict_the_next_token(c, target):
    path, _ = target
    _, rows = read_dump(path)
    assert rows.dtype == np.float32 and rows.shape == (len(IDS), c.op_plan().vocab)
    # Raw bytes are little-endian float32 [positions, vocab], row-major.
    raw = np.fromfile(path, dtype="<f4").reshape(len(IDS), -1)
    assert np.array_equal(raw, rows)
    st = c.executor().start()
    first = st.prefill([IDS[0]])[-1]
    assert np.array_equal(rows[0], first)
    for i, tok in enumerate(IDS[1:], start=1):
        assert np.array_equal(rows[i], st.step(tok))
    # Row i is the prediction after tokens 0..i: it agrees with batch prefill's row i.
    batch = c.executor().forward(IDS)
    assert np.abs(batch - rows).max() <= 1e-5  # 48x the reference's own prefill vs decode on llama, 2.1e-7
    assert np.array_equal(batch.argmax(axis=1), rows.argmax(axis=1))


def test_draft_at_full_depth_is_bit_identical(c, target, tmp_path):
    path, _ = target
    L = c.graph.num_layers
    dL = tmp_path / f"d{L}.f32"
    dump_logits(c, IDS, vindex3.Draft(L), dL)
    assert np.array_equal(read_dump(dL)[1], read_dump(path)[1])
    rep = score_files(dL, path)
    assert rep.summary.top1 == 1.0
    assert rep.summary.kl_max == 0.0 and all(p.kl == 0.0 for p in rep.positions)
    assert rep.summary.median_target_rank == 0.0


def test_draft_below_full_depth_differs_and_scores_below_exact(c, target, tmp_path):
    path, _ = target
    L = c.graph.num_layers
    d = tmp_path / "short.f32"
    dump_logits(c, IDS, vindex3.Draft(L - 1), d)
    assert not np.array_equal(read_dump(d)[1], read_dump(path)[1])
    rep = score_files(d, path)
    assert rep.summary.kl_mean > 0
    assert rep.draft_depth == L - 1 and rep.draft_executed_layers == list(range(L - 1))


def test_an_int_slice_is_a_draft_depth_and_none_is_full(c, tmp_path):
    assert dump_logits(c, IDS[:3], 1, tmp_path / "a.f32")["draft_depth"] == 1
    assert dump_logits(c, IDS[:3], None, tmp_path / "b.f32")["draft_depth"] is None


def test_swapped_arms_are_refused(c, target, tmp_path):
    path, _ = target
    d = tmp_path / "d1.f32"
    dump_logits(c, IDS, vindex3.Draft(1), d)
    with pytest.raises(SliceError, match="target is not full depth"):
        score_files(path, d)


def test_dumps_of_other_tokens_are_refused(c, target, tmp_path):
    path, _ = target
    d = tmp_path / "other.f32"
    dump_logits(c, IDS[:-1] + [4], vindex3.Draft(1), d)
    with pytest.raises(VindexError, match="differ in token ids"):
        score_files(d, path)


@pytest.mark.parametrize("bad, needle", [(0, "smallest draft is depth 1"), (99, "deeper than the model")])
def test_impossible_depths_are_refused_and_nothing_is_written(c, tmp_path, bad, needle):
    with pytest.raises(SliceError, match=needle):
        dump_logits(c, IDS, vindex3.Draft(bad), tmp_path / "x.f32")
    assert not (tmp_path / "x.f32").exists() and not sidecar_path(tmp_path / "x.f32").exists()


def test_a_layer_range_yields_no_logits_and_is_refused(c, tmp_path):
    with pytest.raises(SliceError, match="LayerRange"):
        dump_logits(c, IDS, vindex3.LayerRange(0, 1), tmp_path / "x.f32")


def test_an_empty_token_list_is_refused(c, tmp_path):
    with pytest.raises(VindexError, match="token id list is empty"):
        dump_logits(c, [], vindex3.Full(), tmp_path / "x.f32")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_draft_at_full_depth_scores_exactly_on_every_family(containers, family, tmp_path):
    fc = vindex3.open(containers(family))
    L = fc.graph.num_layers
    dump_logits(fc, IDS, vindex3.Full(), tmp_path / "t.f32")
    dump_logits(fc, IDS, vindex3.Draft(L), tmp_path / "d.f32")
    assert (tmp_path / "t.f32").read_bytes() == (tmp_path / "d.f32").read_bytes()
    rep = score_files(tmp_path / "d.f32", tmp_path / "t.f32")
    assert rep.summary.top1 == 1.0 and rep.summary.kl_max == 0.0
