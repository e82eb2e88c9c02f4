"""A long fuzz run of LQL (issue 10's acceptance): N cases (a quarter of them documented
statements - catalog examples and docs/lql.md's blocks - the rest generated from the grammar),
half of them mutated, through the Python API on a tiny container, plus a share through `lql`'s
`main` in every output format; each case under a 10 s limit. Counts every outcome (see tests/lql_fuzz.py) and
writes bench/results/fuzz_lql.json with the machine facts. Exit status 1 if any case was an
internal error, ran past its limit, overwrote a file silently or left the model giving other
numbers.

    .venv/bin/python bench/fuzz_lql.py --cases 10000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import lql_fuzz as F
from machine import facts as machine_facts


def _fixtures(tmp: Path) -> tuple[Path, Path]:
    """The tiny llama checkpoint and its container (the suite's own fixture builder)."""
    from fixtures import build_checkpoint

    import vindex3

    ckpt = build_checkpoint("llama", tmp / "ckpt")
    return vindex3.encode(ckpt, tmp / "tiny.vindex3"), ckpt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10000, help="API cases (default 10000)")
    p.add_argument("--cli-share", type=float, default=0.1, help="share of extra cases run through lql's main")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=float, default=10.0, help="seconds a case may take")
    p.add_argument("--out", type=Path, default=HERE / "results" / "fuzz_lql.json")
    args = p.parse_args(argv)

    rng = random.Random(args.seed)
    ch = F.RandomChooser(rng)
    grammar = F.Grammar()
    docs = F.documented(ROOT)
    api, cli = F.Counts(), F.Counts()
    n_cli = int(args.cases * args.cli_share)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fuzz-lql-") as tmp:
        container, ckpt = _fixtures(Path(tmp))
        sb = F.Sandbox(Path(tmp) / "sb", container, ckpt, limit=args.limit)
        with F.hermetic(sb):
            sb.start()
            for i in range(args.cases + n_cli):
                text = F.case(ch, grammar, docs=docs)
                if i < args.cases:
                    outcome, detail, secs = sb.run_api(text)
                    api.add(outcome, text, secs, detail)
                else:
                    fmt = ch.pick(["text", "json", "csv", "tsv", "markdown", "jsonl"])
                    stdin = F.as_stdin(ch, text) if ch.chance(0.3) else None  # the script on stdin
                    outcome, detail, secs = sb.run_cli(text, fmt, stdin=stdin, keep_going=ch.chance(0.3))
                    cli.add(outcome, text, secs, detail)
                if outcome in F.BAD:
                    print(f"case {i}: {outcome}: {text[:200]!r}\n{detail[-800:]}", file=sys.stderr)
                if (i + 1) % 500 == 0:
                    print(f"{i + 1} cases, {time.perf_counter() - t0:.0f} s: api {api.outcomes} cli {cli.outcomes}",
                          file=sys.stderr)
    seconds = time.perf_counter() - t0
    report = {
        "bench": "fuzz_lql", "seed": args.seed, "limit_seconds": args.limit, "seconds": round(seconds, 1),
        "statement_rules": F.statement_kinds(grammar), "documented_statements": len(docs),
        "api": {"cases": api.cases, "outcomes": api.outcomes, "max_case_seconds": round(api.max_seconds, 3),
                "refusal_kinds": dict(sorted(api.refusal_kinds.items(), key=lambda kv: -kv[1])), "failures": api.failures},
        "cli": {"cases": cli.cases, "outcomes": cli.outcomes, "max_case_seconds": round(cli.max_seconds, 3),
                "exit_statuses": dict(sorted(cli.refusal_kinds.items())), "failures": cli.failures},
        "bad": {k: api.outcomes.get(k, 0) + cli.outcomes.get(k, 0) for k in F.BAD},
        "machine": machine_facts(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("seconds", "bad")} | {"api": report["api"]["outcomes"],
                                                                     "cli": report["cli"]["outcomes"]}))
    return 1 if any(report["bad"].values()) else 0


if __name__ == "__main__":
    os.environ.setdefault("VINDEX3_DECODE_THREADS", "1")
    sys.exit(main())
