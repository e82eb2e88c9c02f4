"""Mapped weights in huge pages (vindex3/segments.py): a segment's mapping is marked
MADV_HUGEPAGE (the first reader of a file decides its page-cache folios, and a marked mapping
reads them ahead 2 MB at a time), unless VINDEX3_HUGE_PAGES=0. Advice changes no byte; these
tests check that it is given (the mapping's VmFlags carry ``hg``) where the platform takes it,
and skip, saying why, where it does not."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from vindex3.errors import ConfigError
from vindex3.segments import HUGE_PAGES, Segment, write_segment
from vindex3.switches import set_switch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page-cache advice is checked on Linux only")

SPECS = {f"w{i}": ("f32", (256, 256)) for i in range(8)}  # 2 MB of payload


def _load(name: str) -> np.ndarray:
    return np.full((256, 256), float(name[1:]), np.float32)


def _smaps(path: Path, field: str) -> str:
    """The value of ``field`` (``VmFlags``, ``FilePmdMapped``, ...) in this process's mapping of
    ``path`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            return next(x for x in lines[i + 1:] if x.startswith(field + ":")).split(":", 1)[1].strip()
    raise AssertionError(f"{path} is not mapped")


def _flags(seg: Path) -> list[str]:
    return _smaps(seg, "VmFlags").split()


def _pmd_kb(path: Path) -> int:
    return int(_smaps(path, "FilePmdMapped").split()[0])


@pytest.mark.parametrize("switch", ["", "0"])
def test_a_segment_is_mapped_with_huge_page_advice_unless_switched_off(tmp_path, monkeypatch, switch):
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("this Python's mmap has no MADV_HUGEPAGE")
    if not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        pytest.skip("this kernel has no transparent huge pages: the advice is refused and ignored")
    monkeypatch.setenv("VINDEX3_HUGE_PAGES", switch)
    set_switch(HUGE_PAGES, "on", None)
    try:
        seg = tmp_path / "s.bin"
        write_segment(seg, "test", SPECS, _load)
        s = Segment(seg)
        for name in SPECS:  # the bytes are the ones written either way
            assert np.array_equal(s.weight(name).dense(), _load(name))
        assert ("hg" in _flags(seg)) == (switch != "0")
    finally:
        set_switch(HUGE_PAGES, "on", None)


def test_a_bad_switch_value_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("VINDEX3_HUGE_PAGES", "yes")
    set_switch(HUGE_PAGES, "on", None)
    try:
        seg = tmp_path / "s.bin"
        write_segment(seg, "test", SPECS, _load)
        with pytest.raises(ConfigError, match="VINDEX3_HUGE_PAGES"):
            Segment(seg).weight("w0").dense()
    finally:
        monkeypatch.delenv("VINDEX3_HUGE_PAGES")
        set_switch(HUGE_PAGES, "on", None)


def _drop(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def test_a_segment_read_afresh_is_mapped_two_megabytes_at_a_time(tmp_path):
    """Reading the header must not leave the file's next pages marked for small-folio readahead:
    a segment dropped from the page cache and read afresh through `Segment` maps about as much
    of itself 2 MB at a time as a bare marked mapping of a file of the same size does (where the
    platform maps any file so: the control says whether it does)."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(os, "posix_fadvise"):
        pytest.skip("no MADV_HUGEPAGE or posix_fadvise here")
    specs = {f"w{i}": ("f32", (1024, 1024)) for i in range(6)}  # 24 MB
    seg = tmp_path / "s.bin"
    write_segment(seg, "test", specs, lambda n: np.full((1024, 1024), float(n[1:]), np.float32))
    control = tmp_path / "control.bin"
    control.write_bytes(seg.read_bytes())
    _drop(control)
    with open(control, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mm.madvise(mmap.MADV_HUGEPAGE)
    arr = np.frombuffer(mm, np.uint8)
    assert int(arr[::4096].astype(np.int64).sum()) >= 0
    want = _pmd_kb(control)
    if want < 8 << 10:
        pytest.skip(f"this kernel and filesystem ({tmp_path}) mapped only {want} kB of a bare marked 24 MB mapping "
                    "2 MB at a time: nothing to compare against")
    _drop(seg)
    s = Segment(seg)
    for name in specs:
        s.tensor_sha256(name)  # the first use's integrity check reads every byte through the mapping
    # at least half the control's: a 2 MB folio the kernel cannot find memory for comes as small
    # ones in either file, and the header's own page keeps the first 2 MB small; reading the
    # header with readahead left 0 kB of 24,576 (measured)
    assert _pmd_kb(seg) >= want // 2, (_pmd_kb(seg), want)
    del arr
