"""The allocator thresholds an executor sets (vindex3.exec.heap): with them, a pass's megabyte
temporaries are served from heap memory already touched instead of fresh pages faulted in on
every first write; ``VINDEX3_MALLOC_TUNE=0`` leaves the process's allocator alone; a bad value is
refused by name before anything runs. Each case runs in its own process, since the thresholds
are the process's."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = platform.libc_ver()[0] == "glibc"
needs_glibc = pytest.mark.skipif(not GLIBC, reason=f"mallopt thresholds are glibc's; this C library is "
                                                   f"{platform.libc_ver()[0] or 'unknown'}")

# Four 3 MB arrays written and freed, ten times over: glibc's own thresholds (after one freed
# 3 MB block lifts its mmap threshold to 3 MB, its trim threshold to 6 MB) give the 12 MB back at
# every round, so each round faults its 3072 pages in again.
PROBE = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    import vindex3
    from vindex3.exec import heap
    before = heap.tuned()
    ex = vindex3.open(sys.argv[1]).executor()
    def round_():
        arrs = [np.ones(3 << 18, np.float32) for _ in range(4)]
        del arrs
    np.ones(3 << 18, np.float32)
    round_()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        round_()
    print(json.dumps({"before": before, "tuned": heap.tuned(),
                      "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0}))
""")
PAGES = 10 * 4 * (3 << 20) // 4096  # pages the rounds write


def _run(code: str, args: list[str], value: str | None):
    """``code`` in a fresh interpreter importing this checkout, VINDEX3_MALLOC_TUNE set to
    ``value`` (None: unset)."""
    # glibc's own settings from the environment would change the untuned control: dropped
    env = {k: v for k, v in os.environ.items()
           if k != "VINDEX3_MALLOC_TUNE" and not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if value is not None:
        env["VINDEX3_MALLOC_TUNE"] = value
    return subprocess.run([sys.executable, "-c", code, *args], check=False, env=env, capture_output=True, text=True,
                          timeout=300)


def _probe(container, value: str | None):
    return _run(PROBE, [str(container)], value)


@needs_glibc
def test_an_executor_keeps_large_temporaries_in_touched_memory(tiny_llama_container):
    import json

    on, off = _probe(tiny_llama_container, None), _probe(tiny_llama_container, "0")
    assert on.returncode == 0 and off.returncode == 0, (on.stderr[-2000:], off.stderr[-2000:])
    on, off = json.loads(on.stdout.splitlines()[-1]), json.loads(off.stdout.splitlines()[-1])
    assert on["before"] is None and on["tuned"] is True  # set when the executor was built, not at import
    assert off["tuned"] is False
    # untuned, glibc gives the 12 MB back every round (a fault a page); tuned, the heap keeps it
    assert off["faults"] >= PAGES // 2, off
    assert on["faults"] <= PAGES // 20, on


@pytest.mark.parametrize("raw", ["yes", "2"])
def test_a_bad_value_is_refused_by_name_before_any_work(tiny_llama_container, raw):
    p = _probe(tiny_llama_container, raw)
    assert p.returncode != 0
    assert "VINDEX3_MALLOC_TUNE" in p.stderr and repr(raw) in p.stderr


def test_results_do_not_depend_on_the_thresholds(tiny_llama_container, tmp_path):
    """The thresholds move arrays between kinds of memory, never a value: a prefill's logits are
    the same bytes in a process that set them and one that did not."""
    code = textwrap.dedent("""
        import sys, numpy as np, vindex3
        c = vindex3.open(sys.argv[1])
        ids = list(range(5, 101))
        st = c.executor().start()
        np.save(sys.argv[2], st.prefill(ids))
    """)
    outs = []
    for value in ("1", "0"):
        out = tmp_path / f"logits_{value}.npy"
        p = _run(code, [str(tiny_llama_container), str(out)], value)
        assert p.returncode == 0, p.stderr[-2000:]
        outs.append(np.load(out))
    assert outs[0].shape[0] == 96 and outs[0].tobytes() == outs[1].tobytes()
