"""What ``activations = 'q8'`` costs in behaviour: SmolLM2-135M-Instruct in int8 and q4, each
under 'exact' and 'q8', against the f32 source container, on the prompt bank of SCORE
REPRESENTATION (tests/data/prompts-v1.jsonl). Unlike SCORE REPRESENTATION (one prefill per
prompt, which runs BLAS tiles with exact activations once a prompt exceeds the rows kernels'
``small_t``), every position here goes through the decode path (a one-token prefill, then one
step per token), which is where 'q8' acts. Per position: KL(f32 ‖ arm) in nats (float64
log-softmax) and argmax agreement; per prompt: greedy-32 agreement (common prefix / 32).

    python bench/intdot_fidelity.py [--max-prompts N] [--greedy 32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from machine import facts


def decode_run(ex, ids: list[int], greedy: int) -> tuple[np.ndarray, list[int]]:
    st = ex.start()
    rows = [st.prefill(ids[:1])[-1]]
    for t in ids[1:]:
        rows.append(st.step(t))
    out, tok = [], int(np.argmax(rows[-1]))
    for _ in range(greedy):
        out.append(tok)
        if len(out) == greedy:
            break
        tok = int(np.argmax(st.step(tok)))
    return np.stack(rows), out


def main() -> int:
    import vindex3
    from vindex3 import default_model
    from vindex3.draft.bank import load_prompts
    from vindex3.evidence import kl_rows
    from vindex3.represent import represent

    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default=str(HERE.parent / "tests" / "data" / "prompts-v1.jsonl"))
    ap.add_argument("--max-prompts", type=int)
    ap.add_argument("--greedy", type=int, default=32)
    ap.add_argument("--dir", help="where the int8/q4 representations are made (default: the vindex3 cache)")
    ap.add_argument("--out", default=str(HERE / "results" / "intdot_fidelity.json"))
    a = ap.parse_args()
    src = default_model.ensure()
    where = Path(a.dir) if a.dir else Path(src).parent / "peer-ggufs"
    where.mkdir(parents=True, exist_ok=True)
    reps = {}
    for enc in ("int8", "q4"):
        p = where / f"smollm2-135m-instruct.{enc}.vindex3"
        if not (p / "index.json").exists():
            represent(src, p, enc)
        reps[enc] = vindex3.open(p)
    ref = vindex3.open(src)
    bank = load_prompts(a.prompts, max_prompts=a.max_prompts)
    arms = {f"{e} {act}": c.executor(activations=act) for e, c in reps.items() for act in ("exact", "q8")}
    ex_ref = ref.executor()
    kl: dict = {k: [] for k in arms}
    top1: dict = {k: [] for k in arms}
    greedy: dict = {k: [] for k in arms}
    t0 = time.perf_counter()
    for i, p in enumerate(bank):
        ids = list(p.token_ids) if p.token_ids is not None else [int(t) for t in ref.tokenizer.encode(p.text)]
        lr, gr = decode_run(ex_ref, ids, a.greedy)
        for name, ex in arms.items():
            lc, gc = decode_run(ex, ids, a.greedy)
            kl[name].extend(kl_rows(lr.astype(np.float64), lc.astype(np.float64)).tolist())
            top1[name].extend((np.argmax(lr, axis=1) == np.argmax(lc, axis=1)).tolist())
            n = next((j for j, (x, y) in enumerate(zip(gr, gc)) if x != y), len(gr))
            greedy[name].append(n / a.greedy)
        print(f"{i + 1}/{len(bank)} {p.id} ({time.perf_counter() - t0:.0f} s)", flush=True)
    summary = {}
    for name in arms:
        k = np.asarray(kl[name])
        summary[name] = {"positions": int(k.size), "kl_p50": float(np.percentile(k, 50)),
                         "kl_p95": float(np.percentile(k, 95)), "kl_max": float(k.max()),
                         "top1": float(np.mean(top1[name])), "greedy": float(np.mean(greedy[name])),
                         "greedy_all_equal": int(sum(g == 1.0 for g in greedy[name])), "prompts": len(greedy[name])}
    doc = {"benchmark": "intdot_fidelity", "reference": "the f32 default container (decode path)",
           "bank": Path(a.prompts).name, "greedy": a.greedy, "machine": facts(None) | {"loadavg_end": os.getloadavg()},
           "summary": summary}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'arm':<12}{'KL p50':>10}{'KL p95':>10}{'KL max':>10}{'top-1':>7}{'greedy':>8}")
    for name, s in summary.items():
        print(f"{name:<12}{s['kl_p50']:>10.2e}{s['kl_p95']:>10.2e}{s['kl_max']:>10.2e}{s['top1']:>7.3f}"
              f"{s['greedy']:>8.3f} ({s['greedy_all_equal']} of {s['prompts']})")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
