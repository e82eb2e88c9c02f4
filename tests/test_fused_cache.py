"""The fused layer functions on numba's disk cache (vindex3.exec.ops.fused_source).

Invariants: ``a_second_process_loads_the_fused_layer_not_compiles_it`` (numba's dispatcher
counts a cache hit and no miss, and the loaded call gives the op-by-op path's bytes);
``a_changed_dependency_never_meets_a_stale_entry`` (the module's name digests the source of
every module whose compiled functions the fused call reaches: a changed kernel gives another
file); ``a_cache_that_cannot_be_written_compiles_in_memory`` (never a failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vindex3.exec.ops import fused_layer as FL
from vindex3.exec.ops import fused_source as S

pytestmark = pytest.mark.numeric

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import hashlib, json, sys
import vindex3
from vindex3.exec.ops import fused_layer as FL, fused_source as S
ex = vindex3.open(sys.argv[1]).executor()
out = {}
for fused in (True, False):
    FL.set_enabled(fused)
    st = ex.start()
    ls = [st.prefill([5, 9, 11])] + [st.prefill([t]) for t in (7, 8)] + [st.prefill([9, 10])]
    out[fused] = hashlib.sha256(b"".join(x.tobytes() for x in ls)).hexdigest()
fns = list(FL._LAYERS.values())
print(json.dumps({"same": out[True] == out[False], "how": list(S.how.values()),
                  "hits": sum(sum(f.stats.cache_hits.values()) for f in fns),
                  "misses": sum(sum(f.stats.cache_misses.values()) for f in fns), "dir": str(S.cache_dir())}))
"""


def _child(container, cache: Path, extra: dict | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CACHE_DIR")}
    env.update(PYTHONPATH=str(ROOT), VINDEX3_CACHE=str(cache), VINDEX3_FUSED_LAYERS="1", **(extra or {}))
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(container)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=900)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_second_process_loads_the_fused_layer_not_compiles_it(tiny_llama_container, tmp_path):
    """Two processes on a cold cache at once (both compile, both write the same file), then a
    third that loads it: a cache hit, no miss, the unfused bytes."""
    cache = tmp_path / "cache"
    first = [_result(p) for p in [_child(tiny_llama_container, cache) for _ in range(2)]]
    for r in first:
        assert r["same"] and r["misses"] == 1 and r["hits"] == 0, r
        assert r["how"] and all(h.startswith("file ") for h in r["how"]), r
    d = cache / S.SUBDIR
    mods = sorted(d.glob("vindex3_fused_*.py"))
    assert len(mods) == 1 and not list(d.glob(".*.tmp"))  # one module, nothing half-written left
    assert list((d / "__pycache__").glob(mods[0].stem + ".layer-*.nbi"))  # numba's index beside it
    again = _result(_child(tiny_llama_container, cache))
    assert again["same"] and again["hits"] == 1 and again["misses"] == 0, again
    assert again["how"] == first[0]["how"]


def test_the_cache_lives_under_numba_cache_dir_or_the_project_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("VINDEX3_CACHE", str(tmp_path / "v"))
    assert S.cache_dir() == tmp_path / "v" / S.SUBDIR
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "n"))
    assert S.cache_dir() == tmp_path / "n" / "vindex3_fused"


KINDS = ("f32", "bf16", "i8", "i8q8", "q4", "q4q8")


def test_a_changed_dependency_never_meets_a_stale_entry(monkeypatch):
    """The module name digests the text and every dependency's source: changing one byte of
    any dependency, or any choice in the text, gives another name."""
    text = S.source(("i8q8", "i8q8", "q4q8", "f32"), (False,) * 4, True, True, "vnni512")
    name = S.module_name(text)
    assert name == S.module_name(text)
    others = {S.module_name(S.source(("i8q8", "i8q8", "q4q8", "f32"), (False,) * 4, True, False, "vnni512")),
              S.module_name(S.source(("i8q8", "i8q8", "q4q8", "f32"), (False,) * 4, True, True, "plain")),
              S.module_name(S.source(("i8q8", "i8q8", "q4q8", "f32"), (True,) + (False,) * 3, True, True, "vnni512"))}
    assert name not in others and len(others) == 3
    real = S.dependency_sources()
    for i, (dep, src) in enumerate(real):
        changed = real[:i] + [(dep, src + b"\n# one more line\n")] + real[i + 1:]
        monkeypatch.setattr(S, "dependency_sources", lambda c=changed: c)
        monkeypatch.setattr(S, "_digest", [])
        assert S.module_name(text) != name, dep
    monkeypatch.setattr(S, "dependency_sources", lambda: real)
    monkeypatch.setattr(S, "_digest", [])
    assert S.module_name(text) == name


def _reached_modules(fn) -> set[str]:
    """The vindex3 modules defining any function the compiled ``fn`` reaches: numba functions
    called by name or as a module attribute, functions held in closures (the kernel
    factories'), the Python functions an @intrinsic runs to emit its code, and theirs."""
    import types

    from numba.core.dispatcher import Dispatcher
    from numba.core.extending import _Intrinsic

    seen, mods, todo = set(), set(), [fn]
    while todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, Dispatcher):
            f = f.py_func
        elif isinstance(f, _Intrinsic):
            f = f._defn
        if not isinstance(f, types.FunctionType):
            continue
        mod = f.__module__ or ""
        if not mod.startswith("vindex3"):
            continue
        mods.add(mod)
        names, codes = set(), [f.__code__]
        while codes:
            c = codes.pop()
            names |= set(c.co_names)
            codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        held = [f.__globals__[n] for n in names if n in f.__globals__]
        held += [getattr(m, n) for m in held if isinstance(m, types.ModuleType) for n in names if hasattr(m, n)]
        held += [c.cell_contents for c in (f.__closure__ or ())]
        todo += [h for h in held if isinstance(h, (Dispatcher, _Intrinsic, types.FunctionType))]
    return mods


@pytest.mark.parametrize("path", ["plain", "best"])
def test_every_function_the_fused_call_reaches_is_in_a_digested_module(monkeypatch, path):
    from vindex3.codecs import intrinsics as I

    path = I.best() if path == "best" else path
    monkeypatch.setattr(S, "cache_dir", lambda: Path(os.devnull) / "no")  # in memory: nothing written
    for kind in KINDS:
        for par in (False, True):
            kinds = (kind, kind, kind, kind)
            text = S.source(kinds, (par,) * 4, False, False, path)
            fn = S.load(("reach",) + kinds, text)
            mods = _reached_modules(fn)
            generated = {m for m in mods if m.startswith(S.module_name(text))}
            assert mods - generated <= set(S.DEPENDENCIES), (kind, sorted(mods - generated - set(S.DEPENDENCIES)))
            assert {"vindex3.codecs.intrinsics" if "q8" in kind or kind in ("f32", "bf16") else "vindex3.codecs.kernels",
                    "vindex3.exec.ops.decode"} <= mods


def test_a_cache_that_cannot_be_written_compiles_in_memory(tiny_llama_container, monkeypatch, tmp_path):
    """The cache directory under a regular file (mkdir fails; as root a read-only mode would
    not): the fused layer is compiled in memory, says so, and gives the unfused bytes."""
    import vindex3

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setattr(S, "cache_dir", lambda: blocker / "fused")
    monkeypatch.setattr(FL, "_LAYERS", {})
    monkeypatch.setattr(S, "how", {})
    ex = vindex3.open(tiny_llama_container).executor()
    outs = {}
    try:
        for fused in (True, False):
            FL.set_enabled(fused)
            st = ex.start()
            outs[fused] = [st.prefill([5, 9, 11])] + [st.prefill([t]) for t in (7, 8)]
    finally:
        FL.set_enabled(None)
    assert all(np.array_equal(a, b) for a, b in zip(outs[True], outs[False]))
    assert list(S.how.values()) and all(h.startswith("memory: ") for h in S.how.values()), S.how
    assert not blocker.read_text()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_cache_dir_compiles_in_memory(tiny_llama_container, tmp_path):
    cache = tmp_path / "ro"
    (cache / S.SUBDIR).mkdir(parents=True)
    (cache / S.SUBDIR).chmod(0o555)
    try:
        r = _result(_child(tiny_llama_container, cache))
    finally:
        (cache / S.SUBDIR).chmod(0o755)
    assert r["same"] and all(h.startswith("memory: ") for h in r["how"]), r


def test_fused_layers_are_on_unless_the_switch_says_0(monkeypatch):
    try:
        monkeypatch.delenv("VINDEX3_FUSED_LAYERS", raising=False)
        FL.set_enabled(None)
        assert FL.enabled()
        monkeypatch.setenv("VINDEX3_FUSED_LAYERS", "0")
        FL.set_enabled(None)
        assert not FL.enabled()
    finally:
        monkeypatch.undo()
        FL.set_enabled(None)
