"""Expert banks stored in another order (a representation's ``permutation``): written hot experts
first from router statistics on a prompt bank (`vindex3 represent --permute-experts`), the
logical identity unchanged, outputs bit-identical to the unpermuted bank's, and a reader that
does not know the field refusing it by name."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from fixtures import VOCAB

import vindex3
from vindex3.cli import main as vx
from vindex3.container import Container
from vindex3.errors import IntegrityError
from vindex3.manifest import parse_index
from vindex3.permute import permute_experts
from vindex3.represent import represent

IDS = [int(t) for t in np.random.default_rng(3).integers(3, VOCAB, 24)]


@pytest.fixture(scope="module")
def bank(tmp_path_factory):
    rng = np.random.default_rng(11)
    path = tmp_path_factory.mktemp("bank") / "bank.jsonl"
    lines = [json.dumps({"id": f"p{i}", "category": "random", "token_ids": [int(t) for t in rng.integers(3, VOCAB, 16)]})
             for i in range(6)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("encoding", ["f32", "q4"])
def test_permuted_banks_give_identical_outputs(containers, bank, tmp_path, encoding):
    src = containers("qwen3_moe")
    if encoding != "f32":
        src = represent(src, tmp_path / f"{encoding}.vindex3", encoding).path
    r = permute_experts(src, tmp_path / "perm.vindex3", bank)
    a, b = vindex3.open(src), vindex3.open(r.path)
    assert r.tensors and r.prompts == 6
    rep = b.manifest.representations["decoder_stack@" + a.manifest.representations[
        next(k for k in a.manifest.representations if k.startswith("decoder_stack"))].encoding]
    assert rep.permutation and set(rep.permutation) == {t.split("/", 1)[1] for t in r.tensors}
    moved = 0
    for name, perm in rep.permutation.items():
        assert perm == r.layers[int(name.split(".")[0])]
        stored_a = np.asarray(a.segments["decoder_stack"].weight(name).dense())
        stored_b = np.asarray(b.segments["decoder_stack"].weight(name).dense())  # the raw stored order
        assert np.array_equal(stored_b, stored_a[perm])  # slot s holds logical expert perm[s]
        moved += perm != sorted(perm)
    assert moved  # the statistics did reorder something
    # the graph, the logical names and shapes are the source's; the outputs are bit-identical
    assert (b.path / "system_graph.json").read_bytes() == (a.path / "system_graph.json").read_bytes()
    assert np.array_equal(b.executor().forward(IDS), a.executor().forward(IDS))
    sa, sb = a.executor().start(), b.executor().start()
    sa.prefill(IDS[:5]), sb.prefill(IDS[:5])
    for t in IDS[5:12]:
        assert np.array_equal(sa.step(t), sb.step(t))
    rec = b.provenance["expert_permutation"]
    assert rec["prompts"]["count"] == 6 and rec["layers"]


def test_cli_writes_a_permuted_container(containers, bank, tmp_path, capsys):
    src = containers("qwen3_moe")
    assert vx(["represent", str(src), str(tmp_path / "p.vindex3"), "--permute-experts", str(bank), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["path"].endswith("p.vindex3") and out["tensors"]
    assert vx(["verify", str(tmp_path / "p.vindex3")]) == 0


def test_a_reader_without_the_field_refuses_it_by_name(containers, bank, tmp_path):
    r = permute_experts(containers("qwen3_moe"), tmp_path / "perm.vindex3", bank)
    index = json.loads((r.path / "index.json").read_text())
    rep = next(v for v in index["representations"].values() if "permutation" in v)
    # an older reader's representation schema: the same keys, without permutation (extra keys forbidden)
    rep["permutation_v2"] = rep.pop("permutation")
    with pytest.raises(IntegrityError, match=r"permutation_v2 is not a known key"):
        parse_index(index)


def test_a_permutation_that_does_not_fit_is_refused_by_name(containers, bank, tmp_path):
    r = permute_experts(containers("qwen3_moe"), tmp_path / "perm.vindex3", bank)
    bad = tmp_path / "bad.vindex3"
    shutil.copytree(r.path, bad)
    index = json.loads((bad / "index.json").read_text())
    rep = next(v for v in index["representations"].values() if "permutation" in v)
    name = next(iter(rep["permutation"]))
    rep["permutation"][name] = rep["permutation"][name][:-1]
    from vindex3.manifest import seal

    index.pop("index_sha256", None)
    (bad / "index.json").write_text(json.dumps(seal(index)))
    with pytest.raises(IntegrityError, match="permutation"):
        Container(bad)


def test_represent_and_shards_keep_a_permuted_bank_permuted(containers, bank, tmp_path):
    from vindex3.shards import ShardContainer, write_shards
    from vindex3.shards.store import HeldSource, read_manifest

    src = containers("qwen3_moe")
    perm = permute_experts(src, tmp_path / "perm.vindex3", bank).path
    # re-encoded in stored order, the permutation carried: the same outputs as the unpermuted int8
    a = vindex3.open(represent(src, tmp_path / "a8.vindex3", "int8").path)
    b = vindex3.open(represent(perm, tmp_path / "b8.vindex3", "int8").path)
    assert any(r.permutation for r in b.manifest.representations.values())
    assert np.array_equal(b.executor().forward(IDS), a.executor().forward(IDS))
    # shard members copy the stored bytes and hand out the logical banks
    c = vindex3.open(perm)
    out = write_shards(c, tmp_path / "set", 2)
    plan, parent = c.op_plan(), c.tensor_source()
    seen = 0
    for e in read_manifest(out)["shards"]:
        member = ShardContainer(out / e["path"])
        held = HeldSource(member)
        for i in range(*e["layers"]):
            for ref in plan.layers[i].operands():
                if len(ref.shape) == 3:
                    assert np.array_equal(held.weight(ref).dense(), parent.weight(ref).dense())
                    seen += 1
    assert seen
