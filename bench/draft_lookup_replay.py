"""Prompt-lookup drafters replayed against recorded greedy continuations: no model runs while a
drafter is judged, so policies compare without the machine's noise.

The greedy continuations are made once (SmolLM2, plain greedy decoding) and kept in a JSON file;
a replay feeds a drafter the prompt and, round by round, the tokens plain greedy decoding emits,
exactly as `vindex3.generate.generate_step` would (the accepted prefix of each proposal and the
full model's next token). A round verifying T positions is charged 1 + c (T - 1) decode steps,
c the measured cost of one more verified position (bench/speculative.py); plain greedy costs one
step a token. The "ceiling" drafter knows the continuation and proposes the longest prefix of it
that occurs anywhere in the context: no context-copying drafter can do better.

    python bench/draft_lookup_replay.py --fit            # the seed list: the adaptive policy's priors
    python bench/draft_lookup_replay.py --bank [--c 0.3 | --curve 1,1.4,1.65,...]  # the prompt bank: predicted speed

``--fit`` measures, on the greedy continuations of the seed list (``vindex3.draft.seeds``, never
the prompt bank), how often the first token a match of length n proposes is accepted and how
often a later one is accepted after the ones before it were — the priors in
`vindex3.draft.lookup` (PRIOR_FIRST, PRIOR_NEXT).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vindex3 import jsonio
from vindex3.draft.costs import PassCosts
from vindex3.draft.lookup import LookupDrafter, LookupIndex
from vindex3.draft.machine import machine_facts

RESULTS = ROOT / "bench" / "results"


def continuations(which: str, n: int, path: Path) -> dict:
    """{id: {category, prompt, tokens}}: plain greedy continuations of the seed list or the bank,
    read from ``path`` when it holds at least ``n`` tokens each, else made and written there."""
    if path.exists():
        got = jsonio.load(path)
        if got.get("n", 0) >= n:
            return got["prompts"]
    import vindex3
    from vindex3 import default_model
    from vindex3.draft import greedy_generate
    from vindex3.draft.slices import make_executor

    c = vindex3.open(Path(default_model.ensure()))
    ex = make_executor(c, vindex3.Full())[0]
    if which == "seeds":
        from vindex3.draft.seeds import SEED_TEXTS

        items = [(f"seed-{i:02d}", "seed", t) for i, t in enumerate(SEED_TEXTS)]
    else:
        from vindex3.draft.bank import default_bank, load_prompts

        items = [(p.id, p.category, p.text) for p in load_prompts(default_bank(ROOT))]
    out = {}
    for pid, cat, text in items:
        ids = list(c.tokenizer.encode(text))
        out[pid] = {"category": cat, "prompt": ids, "tokens": greedy_generate(c, ids, n, ex=ex).tokens}
        print(f"  {pid}: {len(ids)} prompt tokens, {n} generated", flush=True)
    jsonio.write_atomic(path, {"model": c.name, "container_digest": c.digest, "n": n, "prompts": out})
    return out


def replay(drafter, prompt: list[int], tokens: list[int], n: int) -> list[int]:
    """Positions verified by each model call after the prompt's prefill (1: a plain step)."""
    toks = tokens[:n]
    drafter.begin(prompt)
    drafter.accept((toks[0],))
    produced, calls = 1, []
    while produced < n:
        limit = n - produced - 1
        props = [int(t) for t in drafter.propose(limit)] if limit > 0 else []
        truth = toks[produced:]
        j = 0
        while j < len(props) and props[j] == truth[j]:
            j += 1
        emitted = props[:j] + [truth[j]]
        calls.append(1 + len(props))
        produced += len(emitted)
        if produced < n:
            drafter.accept(emitted)
    return calls


class Ceiling:
    """Knows the continuation: proposes the longest prefix of it (up to ``k``) that occurs in the
    context, so it is never rejected."""

    name = "ceiling"

    def __init__(self, tokens: list[int], k: int):
        self.truth, self.k = tokens, k

    def begin(self, prompt):
        self.ctx, self.p = list(prompt), len(prompt)

    def accept(self, toks):
        self.ctx.extend(toks)

    def propose(self, limit):
        pos = len(self.ctx) - self.p
        want = self.truth[pos:pos + min(self.k, limit)]
        s = self.ctx
        for L in range(len(want), 0, -1):
            if any(s[i:i + L] == want[:L] for i in range(len(s) - L + 1)):
                return want[:L]
        return []


def predicted(data: dict, make, n: int, c) -> dict:
    """Speed over plain greedy by category when a pass over T positions costs ``c.cost(T)``
    steps (a `PassCosts`)."""
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for v in data.values():
        calls = replay(make(v), v["prompt"], v["tokens"], n)
        by[v["category"]][0] += n - 1
        by[v["category"]][1] += sum(c.cost(T) for T in calls)
    out = {cat: a / b for cat, (a, b) in sorted(by.items())}
    if "code" in by and "long" in by:
        out["code+long"] = (by["code"][0] + by["long"][0]) / (by["code"][1] + by["long"][1])
    out["overall"] = sum(a for a, _ in by.values()) / sum(b for _, b in by.values())
    return out


def fit(data: dict, n: int, cap: int) -> dict:
    """Per match length (1..cap, the last for every longer one): first-token acceptance and the
    acceptance of a later token after accepted ones, when the longest match's most recent
    continuation is proposed at every generated position."""
    first = defaultdict(lambda: [0, 0])
    later = defaultdict(lambda: [0, 0])
    for v in data.values():
        toks = v["tokens"][:n]
        for i in range(1, len(toks)):
            ix = LookupIndex(cap)
            ix.extend(v["prompt"] + toks[:i])
            L, props = ix.match(cap)
            if not L:
                continue
            truth = toks[i:i + cap]
            first[L][0] += 1
            first[L][1] += props[0] == truth[0]
            for j in range(1, min(len(props), len(truth))):
                if props[:j] == truth[:j]:
                    later[L][0] += 1
                    later[L][1] += props[j] == truth[j]
    return {"first": {str(L): first[L] for L in sorted(first)}, "later": {str(L): later[L] for L in sorted(later)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="measure the priors on the seed list")
    ap.add_argument("--bank", action="store_true", help="predict speed on the prompt bank")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--c", type=float, default=0.3, help="one more verified position, in decode steps")
    ap.add_argument("--curve", default=None,
                    help="cost(T) in steps for T = 1, 2, ... (comma-separated, from 1): replaces --c")
    ap.add_argument("--lookaheads", default="4,8")
    ap.add_argument("--out", default=str(RESULTS / "draft_lookup_replay.json"))
    args = ap.parse_args()
    costs = PassCosts([float(x) for x in args.curve.split(",")]) if args.curve else PassCosts.linear(args.c)
    out: dict = {"benchmark": "draft-lookup-replay", "n": args.n, "c": args.c, "curve": costs.curve(9),
                 "machine": machine_facts()}
    if args.fit:
        seeds = continuations("seeds", 96, RESULTS / "greedy-seeds.json")
        f = fit(seeds, 96, 8)
        print("match length: first-token acceptance (tried) | later-token acceptance (tried)")
        for L in range(1, 9):
            a, b = f["first"].get(str(L), [0, 0]), f["later"].get(str(L), [0, 0])
            print(f"  {L}: {a[1] / a[0] if a[0] else float('nan'):.2f} ({a[0]}) | "
                  f"{b[1] / b[0] if b[0] else float('nan'):.2f} ({b[0]})")
        out["fit_on_seeds"] = f
    if args.bank:
        bank = continuations("bank", args.n, RESULTS / "greedy-bank.json")
        rows = {}
        for k in (int(x) for x in args.lookaheads.split(",")):
            for name, make in (
                (f"adaptive ngram 8 lookahead {k}", lambda v, k=k: LookupDrafter(8, k, verify_cost=costs)),
                (f"adaptive ngram 3 lookahead {k}", lambda v, k=k: LookupDrafter(3, k, verify_cost=costs)),
                (f"fixed ngram 3 lookahead {k}", lambda v, k=k: LookupDrafter(3, k, policy="fixed")),
                (f"ceiling lookahead {k}", lambda v, k=k: Ceiling(v["tokens"], k)),
            ):
                rows[name] = r = predicted(bank, make, args.n, costs)
                print(f"{name:>32}: " + ", ".join(f"{cat} {x:.2f}x" for cat, x in r.items()))
        out["predicted_speed_on_bank"] = rows
    if args.fit or args.bank:
        jsonio.write_atomic(Path(args.out), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
