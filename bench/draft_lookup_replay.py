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
    python bench/draft_lookup_replay.py --bank [--c 0.3 | --curve 1,1.4,1.65,...] [--corpus FILE]  # predicted speed
    python bench/draft_lookup_replay.py --fit-corpus bench/results/lookup_greedy.corpus.jsonl  # CORPUS_PRIOR

``--fit`` measures, on the greedy continuations of the seed list (``vindex3.draft.seeds``, never
the prompt bank), how often the first token a match of length n proposes is accepted and how
often a later one is accepted after the ones before it were — the priors in
`vindex3.draft.lookup` (PRIOR_FIRST, PRIOR_NEXT). ``--fit-corpus`` measures, on a greedy corpus
(bench/lookup_corpus.py) cross-validated over the seed texts, how often a corpus proposal is right
by its suffix length, share and count — `vindex3.draft.lookup.CORPUS_PRIOR` (`fit_corpus`).
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
from vindex3.draft.lookup import CorpusIndex, LookupDrafter, LookupIndex
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


def fit_corpus(lines: list[list[int]], source: list[list[int]], seeds: list[list[int]], folds: int = 5,
               weight: float = 8.0) -> dict:
    """The corpus proposals' chance of being right by `corpus_cell`, cross-validated over the seed
    texts: a corpus line (an opening cut from a sampled text of seed i, then greedy tokens;
    bench/lookup_corpus.py) belongs to fold i mod ``folds``; each fold's lines are read against
    the index of the other folds' lines, at every greedy position (after the opening: the longest
    prefix the line shares with a source text), and the index's proposal for the next token is
    counted right or wrong in its cell. A cell's rate is shrunk toward its share-and-count average
    with ``weight`` pseudo-observations, so a cell with few positions says what its neighbours
    say. Returns the raw counts and the table (`vindex3.draft.lookup.CORPUS_PRIOR`'s shape)."""
    from vindex3.draft.lookup import CORPUS_PRIOR, CorpusIndex, corpus_cell

    def seed_of(t):
        hits = [i for i, s in enumerate(seeds) if t[:len(s)] == s]
        if len(hits) != 1:
            raise SystemExit(f"a corpus line begins {len(hits)} seed texts; --fit-corpus needs one")
        return hits[0]

    def opening(t):
        best = 0
        for s in source:
            j, m = 0, min(len(s), len(t))
            while j < m and s[j] == t[j]:
                j += 1
            best = max(best, j)
        return best

    meta = [(seed_of(t) % folds, opening(t)) for t in lines]
    cells: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for f in range(folds):
        ix = CorpusIndex([t for t, (g, _) in zip(lines, meta) if g != f])
        for t, (g, start) in zip(lines, meta):
            if g != f:
                continue
            for i in range(max(start, 2), len(t)):
                got = ix.next(t[:i])
                if got is not None:
                    cell = corpus_cell(got[1], got[2], got[3])
                    cells[cell][0] += 1
                    cells[cell][1] += got[0] == t[i]
    marg: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for (_, sb, cb), (a, b) in cells.items():
        marg[(sb, cb)][0] += a
        marg[(sb, cb)][1] += b
    table = []
    for n in range(len(CORPUS_PRIOR)):
        rows = []
        for sb in range(len(CORPUS_PRIOR[0])):
            row = []
            for cb in range(len(CORPUS_PRIOR[0][0])):
                a, b = cells.get((n, sb, cb), (0, 0))
                ma, mb = marg.get((sb, cb), (0, 0))
                prior = (mb + 1) / (ma + 2)
                row.append(round((b + weight * prior) / (a + weight), 2))
            rows.append(tuple(row))
        table.append(tuple(rows))
    return {"folds": folds, "weight": weight, "positions": sum(a for a, _ in cells.values()),
            "cells": {str(k): v for k, v in sorted(cells.items())}, "table": table}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="measure the priors on the seed list")
    ap.add_argument("--bank", action="store_true", help="predict speed on the prompt bank")
    ap.add_argument("--n", type=int, default=48)
    ap.add_argument("--c", type=float, default=0.3, help="one more verified position, in decode steps")
    ap.add_argument("--curve", default=None,
                    help="cost(T) in steps for T = 1, 2, ... (comma-separated, from 1): replaces --c")
    ap.add_argument("--lookaheads", default="4,8")
    ap.add_argument("--fit-corpus", default=None, metavar="FILE",
                    help="fit the corpus proposals' chances (CORPUS_PRIOR) on a greedy corpus of bench/lookup_corpus.py")
    ap.add_argument("--source", default=str(RESULTS / "draft_adapter_cv8.corpus.jsonl"),
                    help="the sampled corpus the greedy corpus's openings were cut from")
    ap.add_argument("--corpus", default=None, metavar="FILE", help="with --bank: a lookup corpus for the drafters")
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
    if args.fit_corpus:
        import vindex3
        from vindex3 import default_model
        from vindex3.draft.adapter import read_corpus
        from vindex3.draft.seeds import SEED_TEXTS

        tok = vindex3.open(Path(default_model.ensure())).tokenizer

        def ids(texts):
            return [list(tok.encode(t)) if isinstance(t, str) else [int(x) for x in t] for t in texts]

        # a seed is known by its first 12 tokens (the seed texts differ there)
        f = fit_corpus(ids(read_corpus(args.fit_corpus)), ids(read_corpus(args.source)),
                       [x[:12] for x in ids(SEED_TEXTS)])
        print(f"{f['positions']} held-out positions; CORPUS_PRIOR = (")
        for rows in f["table"]:
            print(f"    {tuple(rows)},")
        print(")")
        out["fit_corpus"] = f | {"corpus": Path(args.fit_corpus).name, "source": Path(args.source).name}
    if args.bank:
        bank = continuations("bank", args.n, RESULTS / "greedy-bank.json")
        corpus = None
        if args.corpus:
            from vindex3.draft.adapter import read_corpus

            corpus = CorpusIndex([[int(x) for x in t] for t in read_corpus(args.corpus)], source=Path(args.corpus).name)
            out["corpus"] = corpus.source
        rows = {}
        for k in (int(x) for x in args.lookaheads.split(",")):
            for name, make in (
                (f"adaptive ngram 8 lookahead {k}", lambda v, k=k: LookupDrafter(8, k, verify_cost=costs)),
                *([(f"adaptive ngram 8 lookahead {k} corpus",
                    lambda v, k=k: LookupDrafter(8, k, verify_cost=costs, corpus=corpus))] if corpus else []),
                (f"adaptive ngram 3 lookahead {k}", lambda v, k=k: LookupDrafter(3, k, verify_cost=costs)),
                (f"fixed ngram 3 lookahead {k}", lambda v, k=k: LookupDrafter(3, k, policy="fixed")),
                (f"ceiling lookahead {k}", lambda v, k=k: Ceiling(v["tokens"], k)),
            ):
                rows[name] = r = predicted(bank, make, args.n, costs)
                print(f"{name:>32}: " + ", ".join(f"{cat} {x:.2f}x" for cat, x in r.items()))
        out["predicted_speed_on_bank"] = rows
    if args.fit or args.bank or args.fit_corpus:
        jsonio.write_atomic(Path(args.out), out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
