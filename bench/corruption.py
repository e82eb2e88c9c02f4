"""A long randomized corruption run over a tiny container (the suite runs the targeted matrix,
tests/test_corruption.py; this runs thousands of random edits).

Each case copies a pristine tiny llama container and applies one random edit to one random file:
bytes flipped (biased towards headers), truncated, extended, zeroed, inserted; a JSON value
replaced by another type or out-of-range number, a key deleted or renamed, deep nesting; the file
replaced by a FIFO, a directory, a symlink out of the container, or removed. A share of the JSON
and header edits is *resealed* (every hash re-recorded, as a hand-written container would be),
so that the value checks behind the hashes are exercised too. The probe of tests/corruption.py
then opens the copy, runs the prompt, compares logits with the pristine run and verifies it,
every step bounded to 10 s; every 10th case also runs ``vindex3 exec`` in-process.

Counts written to bench/results/corruption.json:
  refused     a named refusal at OPEN, first use or VERIFY
  internal    any other exception (a defect)
  hang        a step past the bound (a defect)
  wrong       tampered (not resealed), the run finished with different logits (a defect)
  unnoticed   tampered, same logits and VERIFY passed (a defect of VERIFY, or an edit that
              changed no meaning, e.g. whitespace in index.json: listed for reading)
  resealed_ran  resealed and accepted: a valid container of another model (not a defect)

    python bench/corruption.py [--cases 3000] [--seed 0]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np
from corruption import PROMPT, _bounded, baseline, probe, reseal, segment_header

import vindex3
from vindex3 import jsonio
from vindex3.draft.machine import machine_facts

VALUES = [0, -1, 1, 2**31, 10**30, -(10**30), 0.5, -0.0, 1e-300, 1e300, {"__float__": "NaN"}, {"__float__": "Infinity"},
          {"__float__": "-Infinity"}, "", "x", "silu", "1e-5", True, False, None, [], [1, 2], {}, {"a": 1}, "../../etc/passwd",
          "/etc/passwd", "\u0000", "\ud800"]


def _paths(obj, prefix=()):
    """Every (path, value) in a parsed JSON document."""
    yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _json_edit(rng: random.Random, doc):
    nodes = [(p, v) for p, v in _paths(doc) if p]
    if not nodes:
        return [doc], "wrapped in a list"
    path, _ = rng.choice(nodes)
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    r = rng.random()
    where = ".".join(str(p) for p in path)
    if r < 0.5:
        v = rng.choice(VALUES)
        parent[key] = json.loads(json.dumps(v)) if not (isinstance(v, str) and "\ud800" in v) else v
        return doc, f"{where} := {v!r}"
    if r < 0.7 and isinstance(parent, dict):
        del parent[key]
        return doc, f"{where} deleted"
    if r < 0.85 and isinstance(parent, dict):
        parent[f"{key}_"] = parent.pop(key)
        return doc, f"{where} renamed"
    if r < 0.95:
        parent[key] = [parent[key]] * 2
        return doc, f"{where} doubled into a list"
    return None, f"{where} nested 100000 deep"


def random_case(rng: random.Random, c: Path, files: list[str], outside: Path) -> tuple[str, bool]:
    """Apply one random edit to the container copy ``c``; returns (description, resealed)."""
    rel = rng.choice(files)
    p = c / rel
    data = p.read_bytes()
    r = rng.random()
    seal = False
    if rel.endswith(".json") and r < 0.45:
        seal = rng.random() < 0.35
        try:
            doc = json.loads(data)
        except ValueError:
            doc = None
        if doc is not None:
            new, what = _json_edit(rng, doc)
            if new is None:
                p.write_bytes(data.rstrip()[:-1] + b', "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
            else:
                p.write_text(jsonio.dumps(new) if not _has_surrogate(new) else json.dumps(new))
            seal = seal and _try_reseal(c)
            return f"{rel}: {what}" + (" (resealed)" if seal else ""), seal
    if rel.startswith("segments/") and r < 0.35:
        hlen, header = segment_header(data)
        t = rng.choice(header["tensors"])
        seal = rng.random() < 0.35
        k = rng.choice(["name", "dtype", "shape", "offset", "len"])
        v = rng.choice([t["offset"] + 16, t["offset"] + 2, t["len"] - 4, list(reversed(t["shape"])), "f16", 10**12,
                        header["tensors"][0]["name"], -4, "x"])
        t[k] = v
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) <= hlen:
            p.write_bytes(data[:8] + text + b" " * (hlen - len(text)) + data[8 + hlen:])
            seal = seal and _try_reseal(c)
            return f"{rel}: header tensor {t['name'] if k != 'name' else '?'}.{k} := {v!r}" + (" (resealed)" if seal else ""), seal
    if r < 0.05:
        how = rng.choice(["missing", "directory", "fifo", "symlink out"])
        p.unlink()
        if how == "directory":
            p.mkdir()
        elif how == "fifo":
            os.mkfifo(p)
        elif how == "symlink out":
            outside.mkdir(parents=True, exist_ok=True)
            target = outside / f"{rng.getrandbits(64):x}"
            target.write_bytes(data)
            p.symlink_to(target)
        return f"{rel}: {how}", False
    b = bytearray(data)
    n = len(b)
    op = rng.choice(["flip", "flip", "flip", "truncate", "extend", "zero", "insert"])
    if op == "flip" and n:
        k = rng.randint(1, 8)
        head = rng.random() < 0.5
        for _ in range(k):
            i = rng.randrange(min(n, 512)) if head else rng.randrange(n)
            b[i] ^= 1 << rng.randrange(8)
        what = f"{k} bit(s) flipped" + (" near the start" if head else "")
    elif op == "truncate":
        i = rng.randrange(n + 1) if n else 0
        b = b[:i]
        what = f"truncated to {i} of {n} bytes"
    elif op == "extend":
        b += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
        what = "random bytes appended"
    elif op == "zero" and n:
        i = rng.randrange(n)
        j = min(n, i + rng.randint(1, 256))
        b[i:j] = bytes(j - i)
        what = f"bytes {i}..{j} zeroed"
    else:
        i = rng.randrange(n + 1) if n else 0
        b[i:i] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 16)))
        what = f"random bytes inserted at {i}"
    p.write_bytes(bytes(b))
    return f"{rel}: {what}", False


def _same(c: Path, pristine: Path, files: list[str]) -> bool:
    """Whether every file of ``c`` is still a regular file with the pristine bytes."""
    for rel in files:
        p = c / rel
        if p.is_symlink() or not p.is_file() or p.read_bytes() != (pristine / rel).read_bytes():
            return False
    return True


def _try_reseal(c: Path) -> bool:
    """Reseal when the index can still be read as one; otherwise the edit stays a tampering."""
    try:
        reseal(c)
        return True
    except (ValueError, KeyError, TypeError, AttributeError, OSError, UnicodeError, RecursionError):
        return False


def _has_surrogate(obj) -> bool:
    return any(isinstance(v, str) and any(0xD800 <= ord(ch) <= 0xDFFF for ch in v) for _, v in _paths(obj))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "corruption.json"))
    a = ap.parse_args()

    from fixtures import build_checkpoint

    from vindex3.cli import main as cli

    work = Path(tempfile.mkdtemp(prefix="corruption-"))
    try:
        pristine = vindex3.encode(build_checkpoint("llama", work / "ck"), work / "pristine.vindex3")
        expected = baseline(pristine)
        top = int(np.argmax(expected[-1]))
        files = sorted(str(p.relative_to(pristine)) for p in pristine.rglob("*") if p.is_file())
        rng = random.Random(a.seed)
        counts = {k: 0 for k in ("refused", "internal", "hang", "wrong", "unnoticed", "resealed_ran")}
        stages: dict[str, int] = {}
        defects, unnoticed, accepted = [], [], []
        cli_runs = cli_bad = noop = 0
        worst = 0.0
        t0 = time.perf_counter()
        for i in range(a.cases):
            c = work / "case" / "c.vindex3"
            shutil.rmtree(c.parent, ignore_errors=True)
            shutil.copytree(pristine, c)
            what, sealed = random_case(rng, c, files, work / "outside")
            while _same(c, pristine, files):  # an edit that changed nothing is drawn again
                noop += 1
                shutil.rmtree(c.parent)
                shutil.copytree(pristine, c)
                what, sealed = random_case(rng, c, files, work / "outside")
            o = probe(c, expected)
            worst = max(worst, o.seconds)
            kind = o.kind
            if sealed and kind in ("wrong", "unnoticed"):
                kind = "resealed_ran"
                accepted.append({"case": i, "edit": what, "same_output": o.kind == "unnoticed"})
            counts[kind] += 1
            stages[o.stage] = stages.get(o.stage, 0) + 1
            if kind in ("internal", "hang", "wrong"):
                defects.append({"case": i, "edit": what, "outcome": kind, "stage": o.stage, "detail": o.detail})
                print("DEFECT", defects[-1], flush=True)
            elif kind == "unnoticed":
                unnoticed.append({"case": i, "edit": what})
                print("UNNOTICED", unnoticed[-1], flush=True)
            if i % 10 == 0:
                cli_runs += 1
                out, err = io.StringIO(), io.StringIO()
                with redirect_stdout(out), redirect_stderr(err):
                    code = _bounded(lambda c=c: cli(["exec", str(c), "--prompt", PROMPT, "--json"]))
                bad = code == 3 or "Traceback" in err.getvalue()
                bad = bad or (code == 0 and not sealed and json.loads(out.getvalue())["next_token"] != top)
                if bad:
                    cli_bad += 1
                    defects.append({"case": i, "edit": what, "outcome": f"cli exit {code}", "detail": err.getvalue()[-300:]})
            if (i + 1) % 250 == 0:
                print(f"{i + 1}/{a.cases} cases: {counts}", flush=True)
        seconds = time.perf_counter() - t0
        result = {
            "cases": a.cases, "seed": a.seed, "redrawn_no_op_edits": noop, "counts": counts, "refused_at": stages,
            "cli": {"runs": cli_runs, "internal_or_wrong": cli_bad},
            "worst_case_seconds": round(worst, 3), "seconds": round(seconds, 1),
            "defects": defects[:50], "unnoticed": unnoticed[:50], "resealed_accepted": accepted,
            "machine": machine_facts(),
        }
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: result[k] for k in ("cases", "counts", "refused_at", "cli", "worst_case_seconds", "seconds")}))
        return 1 if defects else 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
