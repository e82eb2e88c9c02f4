"""Decode from mapped segments whose page cache was filled by a mapping asked for in huge pages
(MADV_HUGEPAGE, vindex3/segments.py) against one filled without that advice
(VINDEX3_HUGE_PAGES=0), on a fresh copy of a container. Per round, for each state the copy is
dropped from the page cache, then:

* ``unadvised``: a child maps it unmarked, reads it in decode order and is timed;
* ``then advised``: a second child, marked, maps what the first left and is timed (the folios
  stay as the first reader made them);
* ``advised``: (dropped again) a marked child reads it first and is timed;
* ``hashed``: (dropped again) read through read() as `vindex3 verify` hashes a segment, then a
  marked child is timed.

Each child reports its best ms per decode step over ``--repeats`` runs of ``--steps`` steps,
and how many kB of the segments the kernel maps 2 MB at a time (FilePmdMapped).

    python bench/mapped_huge.py [--container DIR] [--rounds 3] [--out bench/results/mapped_huge.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from intdot_vs_llamacpp import drop_page_cache, pmd_mapped_kb
from machine import child_json, facts, pin_threads

STATES = ("unadvised", "then advised", "advised", "hashed")


def arm(path: str, steps: int, repeats: int) -> dict:
    import vindex3

    st = vindex3.open(path).executor().start()
    st.prefill(list(range(100, 116)))
    for i in range(4):  # warm: compile, and read the weights in
        st.step(300 + i)
    st.truncate(16)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(steps):
            st.step(200 + i)
        best = min(best, (time.perf_counter() - t0) / steps)
        st.truncate(16)
    return {"ms_per_step": best * 1000.0, "file_pmd_mapped_kb": pmd_mapped_kb()}


def write_copy(src: Path, dst: Path, chunk: int) -> None:
    """Every file of ``src`` written to ``dst`` with plain writes of ``chunk`` bytes, whose pages
    stay cached (a filesystem with large folios makes them about the size of each write)."""
    if dst.exists():
        shutil.rmtree(dst)
    for f in sorted(src.rglob("*")):
        out = dst / f.relative_to(src)
        if f.is_dir():
            out.mkdir(parents=True, exist_ok=True)
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(f, "rb") as a, open(out, "wb") as b:
            while part := a.read(chunk):
                b.write(part)
            b.flush()
            os.fsync(b.fileno())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--container")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=1 << 22, help="bytes per write of the copy")
    ap.add_argument("--out", default=str(HERE / "results" / "mapped_huge.json"))
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm:
        print(json.dumps(arm(a.arm, a.steps, a.repeats)))
        return 0
    pin_threads(1)
    if a.container:
        src = Path(a.container)
    else:
        from vindex3 import default_model

        src = Path(default_model.ensure())
    runs: dict[str, list[dict]] = {k: [] for k in STATES}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp:
        copy = Path(tmp) / src.name
        write_copy(src, copy, a.chunk)
        for r in range(a.rounds):
            for state in STATES:
                if state != "then advised":
                    drop_page_cache([copy])
                if state == "hashed":
                    from vindex3.segments import sha256_file

                    for f in sorted(copy.rglob("*.bin")):
                        sha256_file(f)
                env = dict(os.environ, VINDEX3_HUGE_PAGES="0" if state == "unadvised" else "1")
                got = child_json([sys.executable, __file__, "--arm", str(copy), "--steps", str(a.steps),
                                  "--repeats", str(a.repeats)], env, state)
                runs[state].append(got)
                print(f"round {r} {state}: {got['ms_per_step']:.2f} ms a step, {got['file_pmd_mapped_kb']} kB mapped "
                      f"2 MB at a time (load {os.getloadavg()[0]:.1f})", flush=True)
    med = {k: statistics.median(x["ms_per_step"] for x in v) for k, v in runs.items()}
    print("median ms a step: " + ", ".join(f"{k} {v:.2f} ({v / med['advised']:.2f}x advised)" for k, v in med.items()))
    doc = {"bench": "mapped_huge", "container": src.name, "write_chunk_bytes": a.chunk, "steps": a.steps, "repeats": a.repeats, "rounds": a.rounds,
           "median_ms_per_step": med,
           "advised_speedup_over": {k: v / med["advised"] for k, v in med.items()}, "runs": runs,
           "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg()), "machine": facts(1)}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
