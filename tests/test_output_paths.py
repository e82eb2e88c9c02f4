"""Nothing is overwritten by surprise: dumps and ladder reports check their paths before any
work, replace an existing file only with overwrite=True, never replace or delete a sidecar that
is not theirs, never write inside the open container, and leave no temporary file behind."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import vindex3
from vindex3.draft import dump_logits, read_dump, run_ladder, sidecar_path
from vindex3.draft import dumps as dumps_mod
from vindex3.errors import ConfigError, LimitExceeded, PathRefused

IDS = [1, 5, 9, 33]


@pytest.fixture(scope="module")
def c(tiny_llama_container):
    return vindex3.open(tiny_llama_container)


def refused(fn, *a, **k) -> PathRefused:
    with pytest.raises(PathRefused) as e:
        fn(*a, **k)
    return e.value


def test_an_existing_dump_is_replaced_only_when_asked(c, tmp_path):
    p = tmp_path / "x.f32"
    first = dump_logits(c, IDS, None, p)
    before = p.read_bytes(), sidecar_path(p).read_bytes()
    e = refused(dump_logits, c, IDS[:2], None, p)
    assert e.reason == "exists" and "OVERWRITE" in e.hint
    assert (p.read_bytes(), sidecar_path(p).read_bytes()) == before
    second = dump_logits(c, IDS[:2], None, p, overwrite=True)
    assert second["positions"] == 2 and first["positions"] == 4
    meta, logits = read_dump(p)
    assert logits.shape == (2, 320) and meta["data_sha256"] == second["data_sha256"]


def test_the_target_is_checked_before_anything_runs(c, tmp_path, monkeypatch):
    (tmp_path / "x.f32").write_bytes(b"mine")

    def no_run(*a, **k):
        raise AssertionError("the model ran before the path was checked")

    monkeypatch.setattr(dumps_mod, "make_executor", no_run)
    assert refused(dump_logits, c, IDS, None, tmp_path / "x.f32").reason == "exists"
    assert refused(dump_logits, c, IDS, None, tmp_path / "no" / "x.f32").reason == "parent_missing"
    assert refused(dump_logits, c, IDS, None, tmp_path).reason == "not_a_file"
    assert refused(dump_logits, c, IDS, None, "").reason == "empty"
    assert refused(dump_logits, c, IDS, None, "a\0b").reason == "nul"
    assert refused(dump_logits, c, IDS, None, "x" * 300 + ".f32").reason == "name_too_long"
    assert refused(dump_logits, c, IDS, None, "/dev/null", overwrite=True).reason == "special"


def test_into_a_directory_deletes_no_sidecar_and_leaves_no_temp(c, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    user = tmp_path / "out.meta.json"  # not a dump sidecar: somebody's file
    user.write_text('{"mine": true}')
    refused(dump_logits, c, IDS, None, out, overwrite=True)
    assert user.read_text() == '{"mine": true}'
    assert sorted(os.listdir(tmp_path)) == ["out", "out.meta.json"]


def test_a_sidecar_that_is_not_ours_is_never_replaced(c, tmp_path):
    dump_logits(c, IDS, None, tmp_path / "a.f32")
    side = (tmp_path / "a.meta.json").read_bytes()
    e = refused(dump_logits, c, IDS, None, tmp_path / "a.bin", overwrite=True)  # same stem: same sidecar
    assert "belongs to another dump (a.f32)" in str(e)
    assert (tmp_path / "a.meta.json").read_bytes() == side and not (tmp_path / "a.bin").exists()
    (tmp_path / "b.meta.json").write_text("[1, 2]")
    e = refused(dump_logits, c, IDS, None, tmp_path / "b.f32", overwrite=True)
    assert "not a logit-dump sidecar" in str(e) and (tmp_path / "b.meta.json").read_text() == "[1, 2]"


def test_nothing_is_written_inside_the_open_container(c, tmp_path):
    index = (c.path / "index.json").read_bytes()
    for target in (c.path / "index.json", c.path / "segments" / "embedding.bin", c.path / "new.f32",
                   c.path / "segments" / "new.f32"):
        assert refused(dump_logits, c, IDS, None, target, overwrite=True).reason == "inside"
    link = tmp_path / "link"
    link.symlink_to(c.path)
    assert refused(dump_logits, c, IDS, None, link / "x.f32").reason == "inside"
    assert (c.path / "index.json").read_bytes() == index
    assert sorted(p.name for p in c.path.iterdir()) == sorted(
        ["index.json", "system_graph.json", "segments", "tokenizer.json", "tokenizer_config.json", "generation_config.json"])


def test_a_fifo_target_is_refused_at_once(c, tmp_path):
    os.mkfifo(tmp_path / "f.f32")
    t0 = time.perf_counter()
    assert refused(dump_logits, c, IDS, None, tmp_path / "f.f32", overwrite=True).reason == "special"
    assert time.perf_counter() - t0 < 5


def test_a_failed_write_leaves_no_temporary_file(c, tmp_path, monkeypatch):
    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dumps_mod.os, "replace", full_disk)
    with pytest.raises(OSError):
        dump_logits(c, IDS, None, tmp_path / "x.f32")
    assert os.listdir(tmp_path) == []


# ---- the ladder ---------------------------------------------------------------------------------


def _bank(path: Path, ids: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "category": "c", "token_ids": [1, 5, 9]}) + "\n" for i in ids))
    return path


def test_ladder_paths_are_checked_before_the_first_dump(c, tmp_path):
    bank = _bank(tmp_path / "bank.jsonl", ["p"])
    calls = []
    (tmp_path / "report.json").write_text("{}")
    for out, reason in ((tmp_path, "not_a_file"), (tmp_path / "report.json", "exists"),
                        (tmp_path / "no" / "r.json", "parent_missing"), (c.path / "r.json", "inside")):
        e = refused(run_ladder, c, [1], bank, out_path=out, progress=lambda *a: calls.append(a))
        assert e.reason == reason
    e = refused(run_ladder, c, [1], bank, work_dir=c.path / "work", progress=lambda *a: calls.append(a))
    assert e.reason == "inside"
    assert calls == [] and (tmp_path / "report.json").read_text() == "{}"
    run_ladder(c, [1], bank, out_path=tmp_path / "report.json", overwrite=True)
    assert json.loads((tmp_path / "report.json").read_text())["prompts"] == 1


def test_prompt_ids_cannot_leave_the_work_directory(c, tmp_path):
    ids = ["a/b", "../../escape", "..", ".", "x" * 400, "名前"]
    bank = _bank(tmp_path / "bank.jsonl", ids)
    wd = tmp_path / "work"
    rep = run_ladder(c, [1], bank, work_dir=wd)
    assert [p.id for p in rep.rows[0].per_prompt] == ids
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert all(p.parent == wd for p in files if p.name != "bank.jsonl")
    assert len([p for p in files if p.suffix == ".f32"]) == 2 * len(ids)
    # a kept work directory is not overwritten by a second run unless asked
    with pytest.raises(PathRefused, match="already exists"):
        run_ladder(c, [1], bank, work_dir=wd)
    run_ladder(c, [1], bank, work_dir=wd, overwrite=True)


def test_a_bank_over_the_limit_or_not_a_file_is_refused_by_name(c, tmp_path):
    bank = _bank(tmp_path / "bank.jsonl", ["a", "b", "c"])
    with pytest.raises(LimitExceeded, match="more than 2 prompts"):  # a limit, by name
        run_ladder(c, [1], bank, max_prompts=2)
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(ConfigError, match="FIFO"):
        run_ladder(c, [1], tmp_path / "fifo.jsonl")
    with pytest.raises(ConfigError, match="directory"):
        run_ladder(c, [1], tmp_path)
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match="deep.jsonl line 1"):
        run_ladder(c, [1], tmp_path / "deep.jsonl")


def test_read_dump_refuses_a_sidecar_with_impossible_numbers(c, tmp_path):
    p = tmp_path / "x.f32"
    dump_logits(c, IDS, None, p)
    side = sidecar_path(p)
    meta = json.loads(side.read_text())
    meta["positions"] = "4"
    side.write_text(json.dumps(meta))
    with pytest.raises(vindex3.errors.IntegrityError, match="non-negative integers"):
        read_dump(p)
    assert np.frombuffer(p.read_bytes(), "<f4").size == 4 * 320
