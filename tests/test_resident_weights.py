"""VINDEX3_WEIGHTS=resident: segments read into private memory (huge pages asked for) instead
of mapped. The bytes, and so every result, are the mapped ones; the copy is read-only; a bad
value and a copy the machine has no memory for are refused by name before any byte is read."""

from __future__ import annotations

import numpy as np
import pytest

import vindex3
from vindex3 import segments
from vindex3.errors import ConfigError, LimitExceeded
from vindex3.switches import check_all, weights_mode


def test_resident_weights_give_the_mapped_bytes(tiny_llama_container, monkeypatch):
    copies = []
    real = segments._resident

    def spy(f, size, what):
        a = real(f, size, what)
        copies.append(a)
        return a

    monkeypatch.setattr(segments, "_resident", spy)
    ids = [1, 5, 9, 2, 7]
    monkeypatch.delenv("VINDEX3_WEIGHTS", raising=False)
    mapped = vindex3.open(tiny_llama_container).executor().start().prefill(ids)
    assert not copies  # mapped: no segment was copied
    monkeypatch.setenv("VINDEX3_WEIGHTS", "resident")
    resident = vindex3.open(tiny_llama_container).executor().start().prefill(ids)
    assert copies, "resident: no segment was read into memory"
    assert np.array_equal(mapped, resident)
    for a in copies:
        assert not a.flags.writeable
        with pytest.raises(ValueError):
            a[:1] = 0


@pytest.mark.parametrize("raw,want", [(None, "mapped"), ("", "mapped"), ("mapped", "mapped"), ("resident", "resident")])
def test_the_setting_is_read_from_the_environment(raw, want, monkeypatch):
    if raw is None:
        monkeypatch.delenv("VINDEX3_WEIGHTS", raising=False)
    else:
        monkeypatch.setenv("VINDEX3_WEIGHTS", raw)
    assert weights_mode() == want


def test_another_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("VINDEX3_WEIGHTS", "ram")
    with pytest.raises(ConfigError, match="VINDEX3_WEIGHTS='ram'"):
        weights_mode()
    with pytest.raises(ConfigError, match="VINDEX3_WEIGHTS"):
        check_all()


def test_a_copy_larger_than_the_available_memory_is_refused_before_reading(tiny_llama_container, monkeypatch):
    monkeypatch.setenv("VINDEX3_WEIGHTS", "resident")
    monkeypatch.setattr(segments, "available_memory", lambda: 1 << 20)
    allocated = []
    real = segments.mmap

    class Spy:  # the segments module's own view of mmap: an anonymous allocation is recorded
        def __getattr__(self, name):
            return getattr(real, name)

        def mmap(self, fileno, *a, **k):
            if fileno == -1:
                allocated.append(a)
            return real.mmap(fileno, *a, **k)

    monkeypatch.setattr(segments, "mmap", Spy())
    c = vindex3.open(tiny_llama_container)
    with pytest.raises(LimitExceeded, match="MiB available"):
        c.executor()
    assert not allocated


def test_a_system_that_reports_no_available_memory_is_refused(tiny_llama_container, monkeypatch):
    monkeypatch.setenv("VINDEX3_WEIGHTS", "resident")
    monkeypatch.setattr(segments, "available_memory", lambda: None)
    with pytest.raises(LimitExceeded, match="does not report its available memory"):
        vindex3.open(tiny_llama_container).executor()
