"""The depth ladder on the real model (SmolLM2-135M-Instruct, 30 layers).

Dumps the full model's logits once per prompt of the frozen bank, dumps each draft depth, scores
every depth against the target through the dump sidecars, prints one row per depth and writes
bench/results/draft_ladder.json (full per-prompt detail, machine facts). Depth L must score
top-1 = 1.0 and KL = 0 exactly (Draft(L) is the full program); the script fails otherwise.

    python bench/draft_ladder.py [--container DIR] [--depths 1,2,4,8,16,24,30]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vindex3
from lql.statements.drafts import ladder_text
from vindex3.draft import run_ladder
from vindex3.draft.bank import default_bank


def container_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from vindex3 import default_model

    return Path(default_model.ensure())


def progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<32}", end="",
          file=sys.stderr, flush=True)
    if done == total:
        print(file=sys.stderr)


def markdown(report) -> str:
    lines = [
        "| depth | positions | top-1 | KL p50 | KL p90 | KL p99 | median target rank | top-5 | top-20 | prepare s | ms/position |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report.rows:
        s = r.summary
        lines.append(
            f"| {r.depth} | {s.positions} | {s.top1:.3f} | {s.kl_p50:.4g} | {s.kl_p90:.4g} | "
            f"{s.kl_p99:.4g} | {s.median_target_rank:g} | {s.top5:.3f} | {s.top20:.3f} | "
            f"{r.prepare_seconds:.3f} | {r.ms_per_position:.2f} |"
        )
    t = report.target
    lines.append(f"| full | {t.positions} | | | | | | | | {t.prepare_seconds:.3f} | {t.ms_per_position:.2f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--container", help="an encoded container (default: the built-in SmolLM2)")
    ap.add_argument("--depths", default="1,2,4,8,16,24,30")
    ap.add_argument("--prompts", help="a prompt bank (default: prompts-v1.jsonl)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_ladder.json"))
    args = ap.parse_args()

    c = vindex3.open(container_path(args.container))
    depths = [int(x) for x in args.depths.split(",")]
    bank = Path(args.prompts) if args.prompts else default_bank(ROOT)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = run_ladder(c, depths, bank, out_path=args.out, progress=progress)
    print(f"container {c.name}  digest {c.digest[:16]}…  layers {report.model_layers}  "
          f"prompts {report.prompts} ({', '.join(report.categories)})  {time.perf_counter() - t0:.1f}s")
    print(ladder_text(report))
    print()
    print(markdown(report))
    print()
    print("per category, top-1 by depth:")
    cats = report.categories
    print(f"{'depth':>5} " + " ".join(f"{c_:>11}" for c_ in cats))
    for r in report.rows:
        print(f"{r.depth:>5} " + " ".join(f"{r.per_category[c_].top1:>11.3f}" for c_ in cats))
    print(f"wrote {Path(args.out).relative_to(ROOT) if Path(args.out).is_relative_to(ROOT) else args.out}")

    L = report.model_layers
    last = next((r for r in report.rows if r.depth == L), None)
    if last is not None:
        s = last.summary
        exact = s.top1 == 1.0 and s.kl_max == 0.0
        print(f"depth {L} (= full): top-1 {s.top1}, max KL {s.kl_max} -> {'exact' if exact else 'NOT EXACT'}")
        if not exact:
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
