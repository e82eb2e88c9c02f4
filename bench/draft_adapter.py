"""Fitted exit adapters on the real model: top-1 agreement of Draft(d) with the full model over
the held-out prompt bank, with and without an adapter fitted on the seed list (never the bank),
at each depth. Writes bench/results/draft_adapter.json with machine facts.

    python bench/draft_adapter.py [--container DIR] [--depths 8,16,24] [--ridge 1.0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vindex3
from vindex3 import jsonio
from vindex3.draft.adapter import adapter_executor, fit_adapter
from vindex3.draft.bank import default_bank, load_prompts
from vindex3.draft.machine import machine_facts


def container_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from vindex3 import default_model

    return Path(default_model.ensure())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--container")
    ap.add_argument("--depths", default="8,16,24")
    ap.add_argument("--ridge", type=float, default=1.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_adapter.json"))
    args = ap.parse_args()
    c = vindex3.open(container_path(args.container))
    bank = [c.tokenizer.encode(p.text) for p in load_prompts(default_bank(ROOT))]
    full = c.executor()
    ref = [full.start().prefill(ids).argmax(-1) for ids in bank]
    rows = []
    for d in (int(x) for x in args.depths.split(",")):
        t0 = time.perf_counter()
        ad = fit_adapter(c, d, ridge=args.ridge)
        fit_s = time.perf_counter() - t0
        plain_ex = c.executor(slice=vindex3.Draft(d))
        ad_ex, _ = adapter_executor(c, d, ad)
        agree_plain = agree_ad = total = 0
        for ids, r in zip(bank, ref, strict=True):
            agree_plain += int((plain_ex.start().prefill(ids).argmax(-1) == r).sum())
            agree_ad += int((ad_ex.start().prefill(ids).argmax(-1) == r).sum())
            total += len(ids)
        row = {"depth": d, "positions": total, "top1_plain": agree_plain / total, "top1_adapter": agree_ad / total,
               "fit_seconds": fit_s, "adapter": ad.facts.model_dump()}
        rows.append(row)
        print(f"depth {d:>2}: top-1 {row['top1_plain']:.3f} plain, {row['top1_adapter']:.3f} with adapter "
              f"(fit on {ad.facts.positions} seed positions, residual {ad.facts.fit_residual:.3f} vs "
              f"{ad.facts.identity_residual:.3f} unadapted, {fit_s:.1f} s)")
    out = {"benchmark": "draft_adapter", "container": c.name, "container_digest": c.digest, "ridge": args.ridge,
           "rows": rows, "machine": machine_facts()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    jsonio.write_atomic(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
