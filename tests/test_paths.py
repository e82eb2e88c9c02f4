"""vindex3.paths: every path is checked for what its operation needs before any work, and
every problem is a PathRefused with a stable reason code (never an OSError, ValueError or
UnicodeEncodeError, never a blocked FIFO)."""

from __future__ import annotations

import os
import time

import pytest

from vindex3 import paths
from vindex3.errors import PathRefused


def reason(fn, *a, **k) -> str:
    with pytest.raises(PathRefused) as e:
        fn(*a, **k)
    assert str(e.value).strip()
    return e.value.reason


@pytest.mark.parametrize("text, code", [
    ("", "empty"),
    ("a\0b", "nul"),
    ("bad\ud800name", "unencodable"),
    ("x" * 256, "name_too_long"),
    ("d/" + "é" * 128, "name_too_long"),  # 256 bytes in 128 characters
    ("/".join(["abc"] * 1100), "too_long"),
])
def test_path_text_is_checked(text, code):
    assert reason(paths.check_text, text, "dump") == code


def test_a_path_must_be_text():
    assert reason(paths.check_text, 42, "dump") == "type"
    assert paths.check_text(b"ok.f32") == paths.Path("ok.f32")


def test_existing_file_refuses_what_is_not_a_regular_file(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to("loop")
    assert paths.existing_file(tmp_path / "f") == tmp_path / "f"
    assert reason(paths.existing_file, tmp_path / "nope") == "missing"
    assert reason(paths.existing_file, tmp_path / "d") == "not_a_file"
    assert reason(paths.existing_file, tmp_path / "fifo") == "special"
    assert reason(paths.existing_file, "/dev/null") == "special"
    assert reason(paths.existing_file, tmp_path / "loop") == "loop"
    assert reason(paths.existing_file, tmp_path / "f" / "below") == "missing"


def test_confined_paths_stay_inside_their_root(tmp_path):
    root = tmp_path / "c"
    (root / "segments").mkdir(parents=True)
    (root / "segments" / "a.bin").write_bytes(b"1")
    (tmp_path / "outside.bin").write_bytes(b"1")
    (root / "segments" / "out.bin").symlink_to(tmp_path / "outside.bin")
    (root / "segments" / "in.bin").symlink_to("a.bin")
    assert paths.existing_file("segments/a.bin", within=root) == root / "segments" / "a.bin"
    assert paths.existing_file("segments/in.bin", within=root) == root / "segments" / "in.bin"
    assert reason(paths.confined, root, str(tmp_path / "outside.bin")) == "absolute"
    assert reason(paths.confined, root, "segments/../../outside.bin") == "dotdot"
    assert reason(paths.confined, root, "segments/out.bin") == "outside"
    assert reason(paths.confined, root, 7) == "type"


def test_output_file_checks_before_anything_is_written(tmp_path):
    (tmp_path / "exists.f32").write_bytes(b"keep")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    container = tmp_path / "box.vindex3"
    container.mkdir()
    (tmp_path / "alias").symlink_to(container)
    assert paths.output_file(tmp_path / "new.f32") == tmp_path / "new.f32"
    assert reason(paths.output_file, tmp_path / "exists.f32") == "exists"
    assert paths.output_file(tmp_path / "exists.f32", overwrite=True) == tmp_path / "exists.f32"
    assert reason(paths.output_file, tmp_path / "dir", overwrite=True) == "not_a_file"
    assert reason(paths.output_file, tmp_path / "fifo", overwrite=True) == "special"
    assert reason(paths.output_file, "/dev/null", overwrite=True) == "special"
    assert reason(paths.output_file, tmp_path / "dangling", overwrite=True) == "special"
    assert reason(paths.output_file, tmp_path / "no" / "x.f32") == "parent_missing"
    assert reason(paths.output_file, tmp_path / "exists.f32" / "x.f32") == "parent_missing"
    for name in (".", "..", "/", f"{tmp_path}/"):
        assert reason(paths.output_file, name) == "not_a_file_name"
    assert reason(paths.output_file, container / "index.json", forbid_inside=[container]) == "inside"
    assert reason(paths.output_file, tmp_path / "alias" / "x.f32", forbid_inside=[container]) == "inside"
    assert (tmp_path / "exists.f32").read_bytes() == b"keep"


def test_output_dir(tmp_path):
    (tmp_path / "f").write_text("x")
    assert paths.output_dir(tmp_path / "new") == tmp_path / "new"
    assert reason(paths.output_dir, tmp_path) == "exists"
    assert paths.output_dir(tmp_path, exist_ok=True) == tmp_path
    assert reason(paths.output_dir, tmp_path / "f", exist_ok=True) == "not_a_directory"
    assert reason(paths.output_dir, tmp_path / "a" / "b") == "parent_missing"
    assert reason(paths.output_dir, tmp_path / "w", forbid_inside=[tmp_path]) == "inside"


def test_open_regular_never_blocks_on_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    t0 = time.perf_counter()
    assert reason(paths.read_regular, tmp_path / "fifo", max_bytes=10) == "special"
    assert time.perf_counter() - t0 < 2
    (tmp_path / "big").write_bytes(b"x" * 11)
    assert reason(paths.read_regular, tmp_path / "big", max_bytes=10) == "too_large"
    assert paths.read_regular(tmp_path / "big", max_bytes=11) == b"x" * 11


@pytest.mark.parametrize("ident", ["a/b", "../../etc/passwd", ".", "..", "", "x" * 500, "a\0b", "名前", "bad\ud800"])
def test_file_component_cannot_escape(ident, tmp_path):
    name = paths.file_component(ident)
    assert name and name not in (".", "..") and "/" not in name and "\0" not in name
    assert len(name.encode()) <= 100 and not name.startswith(".")
    assert (tmp_path / name).parent == tmp_path


def test_file_components_of_distinct_ids_are_distinct():
    ids = ["a/b", "a_b", "a b", "a\\b", "a:b", "A/B"]
    assert len({paths.file_component(i) for i in ids}) == len(ids)
    assert paths.file_component("plain-id_1.x") == "plain-id_1.x"
