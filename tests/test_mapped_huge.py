"""Mapped weights in huge pages (vindex3/segments.py): a segment's mapping is marked
MADV_HUGEPAGE (the first reader of a file decides its page-cache folios, and a marked mapping
reads them ahead 2 MB at a time), unless VINDEX3_HUGE_PAGES=0. Advice changes no byte; these
tests check that it is given (the mapping's VmFlags carry ``hg``) where the platform takes it,
and skip, saying why, where it does not."""

from __future__ import annotations

import mmap
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


def _flags(seg: Path) -> list[str]:
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(seg)):
            return next(x for x in lines[i + 1:] if x.startswith("VmFlags:")).split()[1:]
    raise AssertionError(f"{seg} is not mapped")


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
