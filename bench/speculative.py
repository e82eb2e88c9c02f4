"""Self-speculative decoding against plain greedy decoding, side by side in one process, on the
real model (SmolLM2-135M-Instruct).

For every prompt chosen from the frozen bank (one per category by default) and every (depth,
lookahead) pair: generate n tokens speculatively and plainly, alternating which runs first, best
of ``--repeats`` wall-clock for each; the tokens must be identical. Writes
bench/results/speculative.json with machine facts and prints acceptance rate, tokens per
full-model step and the wall-clock speed ratio plain/speculative ("speedup"), beside two
predictions from measured pass costs and the observed acceptance histogram: "model" (the
measured cost of a (k+1)-token verification) and "ideal" (if verification cost one step).

    python bench/speculative.py [--container DIR] [--n 32] [--depths 24,28,29] [--lookaheads 1,2,4]

With ``--drafter lookup`` the drafter is prompt lookup (no weights) instead of a draft depth: every
prompt of the bank (``--per-category``, default all), each (ngram, lookahead) pair against plain
greedy interleaved per prompt, and the wall-clock ratio per category, for code and long together,
and overall (bench/results/speculative-lookup.json):

    python bench/speculative.py --drafter lookup [--n 48] [--ngrams 8] [--lookaheads 8] [--policies adaptive,fixed]

The lookup run also measures what one more verified position costs in decode steps (the
figure the adaptive policy's VERIFY_COST stands for). ``--corpus FILE`` gives the lookup drafter a
corpus (JSON lines, ``{"text"}`` or ``{"token_ids"}``) whose n-grams propose when the context has no
match; ``--corpus-ab`` runs every configuration without it too, in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vindex3
from vindex3 import jsonio
from vindex3.draft import greedy_generate, lookup_generate, speculative_generate
from vindex3.draft.bank import default_bank, load_prompts
from vindex3.draft.machine import machine_facts
from vindex3.draft.slices import make_executor


def container_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from vindex3 import default_model

    return Path(default_model.ensure())


def pick_prompts(bank, per_category: int):
    seen: dict[str, int] = {}
    out = []
    for p in bank:
        if seen.get(p.category, 0) < per_category:
            seen[p.category] = seen.get(p.category, 0) + 1
            out.append(p)
    return out


def pass_ms(ex, prompt: list[int], T: int, repeats: int = 5) -> float:
    """Best-of ms for one pass of T tokens (a step when T = 1) after ``prompt``, rolled back
    after each run so that every run sees the same context."""
    st = ex.start()
    st.prefill(prompt)
    base = st.position
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        if T == 1:
            st.step(prompt[-1])
        else:
            st.prefill(prompt[-T:] if len(prompt) >= T else [prompt[-1]] * T)
        best = min(best, time.perf_counter() - t0)
        st.truncate(base)
    return best * 1000.0


def predicted_speedup(hist: list[int], k: int, step: float, draft: float, verify: float) -> float:
    """Speed of speculation over plain decoding from measured pass costs and the observed
    accepted-per-round histogram: a round costs k draft steps, one (k+1)-token verification and,
    when all k are accepted, one catch-up draft step; it yields j+1 tokens."""
    cost = sum(n * (k * draft + verify + (draft if j == k else 0.0)) for j, n in enumerate(hist))
    tokens = sum(n * (j + 1) for j, n in enumerate(hist))
    return tokens * step / cost if cost else 0.0


def ratio(rows: list[dict], phase: str = "") -> float:
    """Plain over speculative wall-clock, summed over the rows (time-weighted, not a mean of
    ratios); ``phase`` "decode_": after the prompt's prefill, which both arms run alike."""
    return sum(x[f"plain_{phase}seconds"] for x in rows) / sum(x[f"spec_{phase}seconds"] for x in rows)


def write_lookup(args, c, prompts, step_ms, verify, results, all_match, load_before, curve=None) -> dict:
    """Write the lookup results so far (JSON with machine facts); returns the best row."""
    best = max(results, key=lambda r: r["speedup_overall"])
    out = {"benchmark": "speculative-lookup", "container": c.name, "container_digest": c.digest,
           "activations": args.activations,
           "model_layers": c.graph.num_layers, "n": args.n, "repeats": args.repeats, "prompts": [p.id for p in prompts],
           "full_step_ms": step_ms, "verify_cost_in_steps": verify, "policy_cost_curve_measured": curve,
           "results": results,
           "best": {k: best[k] for k in best if k != "prompts"}, "all_match_plain": all_match,
           "loadavg_before": load_before, "loadavg_after": list(__import__("os").getloadavg()),
           "machine": machine_facts()}
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / "speculative-lookup.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    jsonio.write_atomic(path, out)
    return best


def lookup_main(args, c, full_ex) -> int:
    bank = load_prompts(default_bank(ROOT))
    prompts = pick_prompts(bank, args.per_category) if args.per_category else list(bank)
    ngrams = [int(x) for x in args.ngrams.split(",")]
    looks = [int(x) for x in args.lookaheads.split(",")]
    ids = {p.id: c.tokenizer.encode(p.text) for p in prompts}
    greedy_generate(c, ids[prompts[0].id], 4, ex=full_ex)  # warm-up
    probe = ids[prompts[0].id]
    step_ms = pass_ms(full_ex, probe, 1, 7)
    verify = {T: pass_ms(full_ex, probe, T, 7) / step_ms for T in (2, 3, 4, 5)}
    print(f"full step {step_ms:.1f} ms; verifying T positions costs " +
          ", ".join(f"T={T}: {v:.2f}" for T, v in verify.items()) + " steps")
    from vindex3.draft.costs import pass_costs

    t_cost = time.perf_counter()
    curve = pass_costs(c, full_ex, max(looks) + 1)  # what the adaptive policy starts from (then learns)
    curve_measured = curve.curve(max(looks) + 1)
    print(f"the adaptive policy's measured cost curve (T = 1..{max(looks) + 1}, {time.perf_counter() - t_cost:.2f} s): "
          + ", ".join(f"{v:.2f}" for v in curve_measured))
    policies = args.policies.split(",")
    load_before = list(__import__("os").getloadavg())
    results, all_match = [], True
    print(f"{'policy':>8} {'ngram':>5} {'k':>2} {'accept':>7} {'tok/full':>8} {'code':>7} {'long':>7} {'code+long':>9} {'overall':>8} {'match':>6}")
    corpora: list = [None]
    if args.corpus:  # a corpus outside the context (vindex3.draft.lookup.CorpusIndex), with and without
        from vindex3.draft.lookup import corpus_index

        ix = corpus_index(c, args.corpus, max(ngrams))
        print(f"corpus {ix.source}: {ix.tokens} tokens, sha256 {ix.digest[:16]}...")
        corpora = [None, ix] if args.corpus_ab else [ix]
    for pol, ng, k, cx in [(pol, ng, k, cx) for pol in policies for ng in ngrams for k in looks for cx in corpora]:
        rows = []
        for i, p in enumerate(prompts):
            pls, sps = [], []
            for r in range(args.repeats):
                # Alternate order so that neither arm always runs on a warmer cache.
                if (i + r) % 2:
                    pls.append(greedy_generate(c, ids[p.id], args.n, ex=full_ex))
                    sps.append(lookup_generate(c, ids[p.id], args.n, k, ng, ex=full_ex, min_ngram=args.min_ngram,
                                               policy=pol, corpus=cx))
                else:
                    sps.append(lookup_generate(c, ids[p.id], args.n, k, ng, ex=full_ex, min_ngram=args.min_ngram,
                                               policy=pol, corpus=cx))
                    pls.append(greedy_generate(c, ids[p.id], args.n, ex=full_ex))
            # best of the repeats for each arm: on a shared machine a run's time is its work plus
            # whatever else ran; the minimum is the closest to the work alone
            pl, sp = min(pls, key=lambda x: x.seconds), min(sps, key=lambda x: x.seconds)
            match = all(x.tokens == pls[0].tokens for x in pls + sps)
            all_match &= match
            rows.append({"id": p.id, "category": p.category, "prompt_tokens": len(ids[p.id]),
                         "matches_plain": match, "proposed": sp.proposed, "accepted": sp.accepted,
                         "acceptance_rate": sp.acceptance_rate, "full_model_calls": sp.full_model_calls,
                         "tokens_per_full_step": sp.tokens_per_full_step, "rounds": sp.rounds,
                         "spec_seconds": sp.seconds, "plain_seconds": pl.seconds,
                         "spec_decode_seconds": sp.seconds - sp.prefill_seconds,
                         "plain_decode_seconds": pl.seconds - pl.prefill_seconds,
                         "verify_costs": sp.verify_costs, "loadavg": os.getloadavg()[0],
                         "corpus_proposed": sp.corpus_proposed, "corpus_accepted": sp.corpus_accepted,
                         "speedup": pl.seconds / sp.seconds})
        cats = sorted({x["category"] for x in rows})
        by_cat = {cat: ratio([x for x in rows if x["category"] == cat]) for cat in cats}
        by_cat_decode = {cat: ratio([x for x in rows if x["category"] == cat], "decode_") for cat in cats}
        cl = [x for x in rows if x["category"] in ("code", "long")]
        prop = sum(x["proposed"] for x in rows)
        acc = sum(x["accepted"] for x in rows) / prop if prop else 0.0
        tps = sum(args.n for _ in rows) / sum(x["full_model_calls"] for x in rows)
        m = all(x["matches_plain"] for x in rows)
        res = {"drafter": "lookup", "policy": pol, "ngram": ng, "min_ngram": args.min_ngram, "lookahead": k,
               "corpus": None if cx is None else {"file": cx.source, "sha256": cx.digest, "tokens": cx.tokens},
               "acceptance_rate": acc,
               "tokens_per_full_step": tps, "speedup_by_category": by_cat,
               "speedup_code_long": ratio(cl) if cl else None, "speedup_overall": ratio(rows),
               "decode_speedup_by_category": by_cat_decode,
               "decode_speedup_code_long": ratio(cl, "decode_") if cl else None,
               "decode_speedup_overall": ratio(rows, "decode_"),
               "all_match_plain": m, "prompts": rows}
        results.append(res)
        if cx is not None:
            print(f"      (with corpus {cx.source}: it proposed {sum(x['corpus_proposed'] for x in rows)}, "
                  f"{sum(x['corpus_accepted'] for x in rows)} kept)")
        print(f"{pol:>8} {ng:>5} {k:>2} {acc:>7.3f} {tps:>8.2f} {by_cat.get('code', float('nan')):>6.2f}x "
              f"{by_cat.get('long', float('nan')):>6.2f}x {res['speedup_code_long'] or float('nan'):>8.2f}x "
              f"{res['speedup_overall']:>7.2f}x {m!s:>6}")
        print("      by category: " + ", ".join(f"{cat} {v:.2f}x" for cat, v in by_cat.items()))
        print("      after the prefill: " + ", ".join(f"{cat} {v:.2f}x" for cat, v in by_cat_decode.items())
              + f"; code+long {res['decode_speedup_code_long'] or float('nan'):.2f}x, overall {res['decode_speedup_overall']:.2f}x"
              + f" (load {os.getloadavg()[0]:.1f})")
        # written after every configuration: a run stopped early keeps what it measured
        write_lookup(args, c, prompts, step_ms, verify, results, all_match, load_before, curve_measured)
    best = write_lookup(args, c, prompts, step_ms, verify, results, all_match, load_before, curve_measured)
    print(f"\nbest: lookup {best['policy']} ngram {best['ngram']} lookahead {best['lookahead']}: {best['speedup_overall']:.2f}x "
          f"plain greedy overall, code+long {best['speedup_code_long']:.2f}x")
    print(f"speculative tokens identical to plain greedy everywhere: {all_match}")
    return 0 if all_match else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--container")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--depths", default="24,28,29")
    ap.add_argument("--lookaheads", default="1,2,4")
    ap.add_argument("--drafter", choices=("depth", "lookup"), default="depth")
    ap.add_argument("--ngrams", default="3", help="with --drafter lookup: the longest n-grams matched")
    ap.add_argument("--min-ngram", type=int, default=1, help="with --drafter lookup: shorter matches propose nothing")
    ap.add_argument("--policies", default="adaptive,fixed", help="with --drafter lookup: proposal policies")
    ap.add_argument("--per-category", type=int, default=None, help="prompts per category (depth: 1, lookup: all)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each arm per prompt (best of)")
    ap.add_argument("--corpus", default=None, help="with --drafter lookup: a JSONL corpus whose n-grams propose when "
                    "the context has no match (vindex3.draft.lookup.CorpusIndex)")
    ap.add_argument("--corpus-ab", action="store_true", help="with --corpus: also run every configuration without it")
    ap.add_argument("--activations", choices=("exact", "q8"), default="exact",
                    help="with --drafter lookup: how int8 / q4 products treat activations (both arms)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    c = vindex3.open(container_path(args.container))
    if args.drafter == "lookup":
        return lookup_main(args, c, make_executor(c, vindex3.Full(), activations=args.activations)[0])
    if args.per_category is None:
        args.per_category = 1
    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / "speculative.json")
    prompts = pick_prompts(load_prompts(default_bank(ROOT)), args.per_category)
    depths = [int(x) for x in args.depths.split(",")]
    looks = [int(x) for x in args.lookaheads.split(",")]
    full_ex, _ = make_executor(c, vindex3.Full())

    # Plain greedy once per prompt: the reference tokens (and a warm-up).
    plain = {}
    for p in prompts:
        ids = c.tokenizer.encode(p.text)
        runs = [greedy_generate(c, ids, args.n, ex=full_ex) for _ in range(args.repeats)]
        plain[p.id] = {"ids": ids, "tokens": runs[0].tokens, "seconds": min(r.seconds for r in runs)}

    # Pass costs behind the ratios: a full step, a full verification of k+1 tokens, a draft step.
    probe = c.tokenizer.encode(prompts[0].text)
    costs = {"full_step_ms": pass_ms(full_ex, probe, 1),
             "full_verify_ms": {k + 1: pass_ms(full_ex, probe, k + 1) for k in looks},
             "draft_step_ms": {d: pass_ms(make_executor(c, vindex3.Draft(d))[0], probe, 1) for d in depths}}
    print(f"full step {costs['full_step_ms']:.1f} ms; verify " +
          ", ".join(f"{t} tokens {v:.1f} ms" for t, v in costs["full_verify_ms"].items()) + "; draft step " +
          ", ".join(f"d{d} {v:.1f} ms" for d, v in costs["draft_step_ms"].items()))

    results = []
    all_match = True
    print(f"{'depth':>5} {'k':>2} {'accept':>7} {'tok/full':>8} {'speedup':>8} {'model':>8} {'ideal':>8} {'match':>6}")
    for d in depths:
        for k in looks:
            per_prompt = []
            for i, p in enumerate(prompts):
                ref = plain[p.id]
                spec_runs = []
                plain_secs = []  # only runs interleaved with the speculative ones
                for r in range(args.repeats):
                    # Alternate order so that neither arm always runs on a warmer cache.
                    if (i + r) % 2:
                        plain_secs.append(greedy_generate(c, ref["ids"], args.n, ex=full_ex).seconds)
                        spec_runs.append(speculative_generate(c, ref["ids"], args.n, d, k))
                    else:
                        spec_runs.append(speculative_generate(c, ref["ids"], args.n, d, k))
                        plain_secs.append(greedy_generate(c, ref["ids"], args.n, ex=full_ex).seconds)
                s = spec_runs[0]
                match = all(x.tokens == ref["tokens"] for x in spec_runs)
                all_match &= match
                spec_best = min(x.seconds for x in spec_runs)
                per_prompt.append({
                    "id": p.id, "category": p.category, "prompt_tokens": len(ref["ids"]),
                    "matches_plain": match, "acceptance_rate": s.acceptance_rate,
                    "tokens_per_full_step": s.tokens_per_full_step, "rounds": s.rounds,
                    "accepted_histogram": s.accepted_histogram, "spec_seconds": spec_best,
                    "plain_seconds": min(plain_secs), "speedup": min(plain_secs) / spec_best,
                })
            acc = sum(x["acceptance_rate"] for x in per_prompt) / len(per_prompt)
            tps = statistics.mean(x["tokens_per_full_step"] for x in per_prompt)
            sp_total = sum(x["plain_seconds"] for x in per_prompt) / sum(x["spec_seconds"] for x in per_prompt)
            m = all(x["matches_plain"] for x in per_prompt)
            hist = [sum(x["accepted_histogram"][j] for x in per_prompt) for j in range(k + 1)]
            pred = predicted_speedup(hist, k, costs["full_step_ms"], costs["draft_step_ms"][d],
                                     costs["full_verify_ms"][k + 1])
            ideal = predicted_speedup(hist, k, costs["full_step_ms"], costs["draft_step_ms"][d],
                                      costs["full_step_ms"])
            results.append({"depth": d, "lookahead": k, "mean_acceptance_rate": acc,
                            "mean_tokens_per_full_step": tps, "speedup_total_time": sp_total,
                            "predicted_speedup": pred, "speedup_if_verify_cost_a_step": ideal,
                            "accepted_histogram": hist, "all_match_plain": m, "prompts": per_prompt})
            print(f"{d:>5} {k:>2} {acc:>7.3f} {tps:>8.2f} {sp_total:>7.2f}x {pred:>7.2f}x {ideal:>7.2f}x {m!s:>6}")

    best = max(results, key=lambda r: r["speedup_total_time"])
    print(f"\nbest: depth {best['depth']} lookahead {best['lookahead']}: "
          f"{best['speedup_total_time']:.2f}x plain greedy wall-clock, acceptance "
          f"{best['mean_acceptance_rate']:.3f}, {best['mean_tokens_per_full_step']:.2f} tokens per full step")
    print(f"speculative tokens identical to plain greedy everywhere: {all_match}")
    out = {
        "benchmark": "speculative", "container": c.name, "container_digest": c.digest,
        "model_layers": c.graph.num_layers, "n": args.n, "repeats": args.repeats,
        "prompts": [p.id for p in prompts], "plain": {k: {"seconds": v["seconds"], "tokens": v["tokens"]}
                                                       for k, v in plain.items()},
        "pass_costs": costs, "results": results, "best": {k: best[k] for k in best if k != "prompts"},
        "all_match_plain": all_match, "machine": machine_facts(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    jsonio.write_atomic(args.out, out)
    return 0 if all_match else 1


if __name__ == "__main__":
    raise SystemExit(main())
