"""Feature metadata: the top tokens each down column writes, as a derived representation inside
the container with provenance, never served stale. Values are checked against numpy on the
checkpoint's own tensors (read with safetensors, not through the container)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from fixtures import build_checkpoint
from internals_oracle import checkpoint_tensors

import vindex3
from vindex3.errors import DerivedStale, QueryRefused
from vindex3.internals import Internals
from vindex3.internals.metadata import DIRECTORY, KIND, METHOD


def _own(tmp_path, containers, family):
    """A private copy of a fixture container (metadata writes into it)."""
    dst = tmp_path / f"{family}.vindex3"
    shutil.copytree(containers(family), dst)
    return dst


def _expected(ckpt, layer, k, tied, fused=False):
    w = checkpoint_tensors(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    pre = "model."
    head = w[pre + "embed_tokens.weight"] if tied else w["lm_head.weight"]
    gamma = w[pre + "norm.weight"]
    if fused:
        down = w[f"{pre}layers.{layer}.shared_mlp.output_linear.weight"]
    else:
        down = w[f"{pre}layers.{layer}.mlp.down_proj.weight"]
    mult = 1.0 / cfg["logits_scaling"] if cfg.get("logits_scaling") else 1.0
    logits = (head.astype(np.float64) @ (gamma[:, None] * down).astype(np.float64)).T * mult  # [features, vocab]
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(logits, ids, axis=1)


@pytest.mark.parametrize("family,tied,fused", [("llama", False, False), ("granite", True, False),
                                               ("granitemoehybrid", True, True)])
def test_metadata_is_the_readout_of_each_down_column(tmp_path, containers, checkpoint_dirs, family, tied, fused):
    ix = Internals(_own(tmp_path, containers, family), k=7)
    note = ix.build_metadata()
    assert note.built_layers == [0, 1, 2, 3]
    for layer in (0, 3):
        ids, logits = ix.metadata.top(layer)
        want_ids, want = _expected(checkpoint_dirs(family), layer, 7, tied, fused)
        assert ids.dtype == np.int32 and logits.dtype == np.float32
        # the same product in float32 numpy is 1.6e-7 of the largest value from this float64 one (ours too)
        assert np.max(np.abs(logits - want)) <= 1e-4 * max(1.0, np.abs(want).max())
        # ids agree wherever the reference's neighbouring logits are not within rounding of a tie (a gap
        # of 1e-4 is far past the product's float32 rounding, 1.6e-7 of its largest value)
        gap = np.abs(np.diff(want, axis=1)).min(axis=1) > 1e-4
        assert np.array_equal(ids[gap], want_ids[gap])


def test_metadata_is_cached_with_provenance_and_the_digest_does_not_change(tmp_path, containers):
    path = _own(tmp_path, containers, "llama")
    c = vindex3.open(path)
    c.rewrite_index(someone_elses_key={"kept": True})  # an unknown key must survive
    digest, gen = c.digest, c.generation
    ix = Internals(path)
    ix.build_metadata([1, 2])
    c2 = vindex3.open(path)
    assert c2.digest == digest
    assert c2.index["someone_elses_key"] == {"kept": True}
    assert c2.generation == gen + 1  # one index rewrite for one build
    e = c2.index["derived"][KIND]
    assert e["source_digest"] == digest and e["params"] == {"k": 10} and e["method"] == METHOD
    assert sorted(e["layers"]) == ["1", "2"] and all(f.startswith(DIRECTORY) for f in e["files"])
    (row,) = c2.derived
    assert row.key == KIND and row.fresh and row.files == 2 and row.bytes == sum(f["bytes"] for f in e["files"].values())
    assert c2.verify().ok
    # a second handle reads the files instead of building
    again = Internals(path).build_metadata([1, 2])
    assert again.built_layers == [] and again.rebuilt is None
    other = Internals(path)
    other.metadata.ensure([2])
    assert np.array_equal(other.metadata.top(2)[0], ix.metadata.top(2)[0])
    assert np.array_equal(other.metadata.top(2)[1], ix.metadata.top(2)[1])


def test_a_changed_container_is_refused_or_rebuilt_never_served_stale(tmp_path, containers):
    """The container's content changes under its derived files (here: another checkpoint's
    weights, with the old derived directory and index entry carried over)."""
    old = _own(tmp_path, containers, "llama")
    Internals(old).build_metadata()
    old_ids = Internals(old).metadata
    assert old_ids.ensure([0]).built_layers == []
    ckpt = build_checkpoint("llama", tmp_path / "ckpt-seed1", seed=1)
    new = vindex3.encode(ckpt, tmp_path / "new.vindex3")
    shutil.copytree(old / "derived", new / "derived")
    c = vindex3.open(new)
    c.rewrite_index(derived=vindex3.open(old).index["derived"])
    assert [r.fresh for r in vindex3.open(new).derived] == [False]
    with pytest.raises(DerivedStale, match=r"stale: the container changed since the feature metadata was built"):
        Internals(new, on_stale="refuse").walk([5, 6], top=1)
    fresh = Internals(new)
    r = fresh.walk([5, 6], top=1)
    assert "the container changed" in r.metadata.rebuilt and r.metadata.built_layers == [0, 1, 2, 3]
    assert not np.array_equal(fresh.metadata.top(0)[1], old_ids.top(0)[1])
    assert [x.fresh for x in vindex3.open(new).derived] == [True]
    assert vindex3.open(new).verify().ok


def test_an_edited_layer_file_is_refused_or_rebuilt(tmp_path, containers):
    path = _own(tmp_path, containers, "llama")
    Internals(path).build_metadata()
    f = path / DIRECTORY / "layer_0002.npz"
    data = bytearray(f.read_bytes())
    data[-40] ^= 0xFF
    f.write_bytes(bytes(data))
    assert not vindex3.open(path).verify().ok  # verify covers derived files too
    with pytest.raises(DerivedStale, match="layer 2 .*layer_0002.npz differs from the SHA-256"):
        Internals(path, on_stale="refuse").build_metadata([2])
    note = Internals(path).build_metadata()
    assert note.built_layers == [2] and "layer 2" in note.rebuilt
    assert vindex3.open(path).verify().ok
    f.unlink()
    assert "is missing" in Internals(path).build_metadata([2]).rebuilt


def test_k_larger_rebuilds_and_smaller_is_served(tmp_path, containers):
    path = _own(tmp_path, containers, "llama")
    Internals(path, k=4).build_metadata()
    small = Internals(path, k=2)
    assert small.build_metadata().built_layers == []  # the top 2 of a sorted top 4
    four = Internals(path, k=4)
    four.metadata.ensure([1])
    assert small.metadata.top(1)[0].shape[1] == 2
    assert np.array_equal(small.metadata.top(1)[0], four.metadata.top(1)[0][:, :2])
    big = Internals(path, k=6)
    note = big.build_metadata([0])
    assert "keeps the top 4 tokens per feature and 6 were asked for" in note.rebuilt
    assert vindex3.open(path).index["derived"][KIND]["params"] == {"k": 6}
    assert sorted(vindex3.open(path).index["derived"][KIND]["layers"]) == ["0"]  # the old entry is gone
    with pytest.raises(QueryRefused, match="k must be an integer in 1..256"):
        Internals(path, k=0)


def test_a_build_reports_its_progress_per_layer(tmp_path, containers):
    seen = []
    Internals(_own(tmp_path, containers, "llama"), progress=lambda *a: seen.append(a)).build_metadata([1, 3])
    assert seen == [(1, 2, "layer 1"), (2, 2, "layer 3")]


def test_mixer_only_layers_have_no_metadata(tmp_path, containers):
    path = _own(tmp_path, containers, "mamba2")
    ix = Internals(path)
    note = ix.build_metadata()
    assert note.built_layers == [] and note.layers == []
    assert "derived" not in vindex3.open(path).index
