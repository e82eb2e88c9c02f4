"""Decode-step weight streaming of the shipped SmolLM2 GGUF kept native (q4_1 layers, q8_0 tied
head: vindex3.codecs.ggml) against the same weights widened to float32, side by side in one
process. One "sweep" multiplies one token (T=1) by every matrix a decode step reads (30 layers x
q, k, v, o, gate, up, down, and the head), through each arm's weight object ``mm`` (what the
executor calls). Rounds are interleaved (each arm once per round); median and best per arm,
and the ratio native / f32 of the medians, are reported with the machine facts.

    python bench/gguf_native.py [--rounds 7] [--out bench/results/gguf_native.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from machine import facts


def weights():
    """(name, f32 weight, native weight) for every matrix of a decode step."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from vindex3 import codecs
    from vindex3.default_model import gguf_path

    r = gguf.GGUFReader(gguf_path(), "r")
    by = {t.name: t for t in r.tensors}
    nl = 1 + max(int(n.split(".")[1]) for n in by if n.startswith("blk."))
    names = [f"blk.{i}.{k}.weight" for i in range(nl)
             for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
    names.append("output.weight" if "output.weight" in by else "token_embd.weight")
    out = []
    for n in names:
        t = by[n]
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        f32 = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        enc = t.tensor_type.name.lower()
        raw = np.frombuffer(np.asarray(t.data).tobytes(), dtype=np.uint8)
        out.append((n, codecs.get("f32").weight(f32.reshape(-1).view(np.uint8), shape), codecs.get(enc).weight(raw, shape)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(HERE / "results" / "gguf_native.json"))
    a = ap.parse_args()
    import numpy as np

    mats = weights()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, w.shape[1])).astype(np.float32) for _, w, _ in mats]
    arms = {"f32": [w for _, w, _ in mats], "native": [n for _, _, n in mats]}
    for ws in arms.values():  # compile and warm
        for w, x in zip(ws, xs):
            w.mm(x)
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(a.rounds):
        for k, ws in arms.items():
            t0 = time.perf_counter()
            for w, x in zip(ws, xs):
                w.mm(x)
            times[k].append(time.perf_counter() - t0)
    nbytes = {k: sum(w.nbytes for w in ws) for k, ws in arms.items()}
    res = {
        "bench": "gguf_native",
        "machine": facts(threads=1),
        "encodings": sorted({n.encoding for _, _, n in mats}),
        "rounds": a.rounds,
        "arms": {k: {"median_s": statistics.median(v), "best_s": min(v), "bytes": nbytes[k],
                     "median_GBps": nbytes[k] / statistics.median(v) / 1e9} for k, v in times.items()},
    }
    res["native_over_f32_median"] = res["arms"]["native"]["median_s"] / res["arms"]["f32"]["median_s"]
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
