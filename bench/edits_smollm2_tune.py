"""The settings sweep for subject-keyed MEMIT on SmolLM2-135M-Instruct, on the held-out tuning set
tests/data/edits_smollm2_tune.jsonl only (10 counterfactual edits of facts the model knows, subjects
disjoint from the scored set's; never read by the scoring bench or SCORE EDITS defaults). For each
setting: the 10 edits one at a time and the 10 together, CounterFact's metrics (no prompt-bank KL:
it is measured for the setting chosen). Each setting's figures are appended to the result file as
they finish, so a cut run keeps what it measured.

    python bench/edits_smollm2_tune.py --value-cache DIR --layers 18-22,14-22 --lams 500,1500,5000 \\
        --mus 0,2,8 [--preserve tests/data/edits_smollm2_preserve.jsonl] [--out edits_smollm2_tune.json]

The value (fitted at the range's last layer) does not depend on lambda, the range's lower layers or
the preservation keys, so with --value-cache every setting after the first reuses the 10 values.
The choice rule, fixed before the run: among settings whose single edits reach efficacy >= 95% and
paraphrase >= 70%, the highest mean of the single and together neighborhood; ties to the lower
prompt-independent cost (smaller mu, then lambda nearer the earlier 1500)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from edits_smollm2 import cache_values
from machine import facts

import vindex3
from vindex3 import default_model
from vindex3.edits import EditedModel, FitSettings, Patch
from vindex3.edits.fit import make_edits, request
from vindex3.edits.score import load_cases, score

TUNE = "tests/data/edits_smollm2_tune.jsonl"


def run(c, base_ex, cases, layers, lam, mu, preserve) -> dict:
    st = FitSettings(lam_subject=lam, preserve=str(ROOT / preserve) if preserve and mu > 0 else None,
                     preserve_weight=mu if preserve else 0.0)
    t0 = time.time()
    singles = []
    for i, cs in enumerate(cases):
        p = Patch(name=f"tune-{i}", base_digest=c.digest, base_name=c.name)
        make_edits(c, p, [request(c, cs.prompt, cs.target, cs.subject)], "memit", layers, st)
        singles.append(score(c, EditedModel(c, [p]), [cs], kl=False, base_executor=base_ex).cases[0])
    p = Patch(name="tune-all", base_digest=c.digest, base_name=c.name)
    make_edits(c, p, [request(c, cs.prompt, cs.target, cs.subject) for cs in cases], "memit", layers, st)
    tog = score(c, EditedModel(c, [p]), cases, kl=False, base_executor=base_ex)
    return {"layers": f"{layers[0]}-{layers[-1]}", "lam": lam, "mu": mu, "preserve": preserve if mu > 0 else None,
            "single": {"efficacy": float(np.mean([x.efficacy for x in singles])),
                       "paraphrase": float(np.mean([x.paraphrase for x in singles])),
                       "neighborhood": float(np.mean([x.neighborhood for x in singles])),
                       "p_target": float(np.mean([x.p_target for x in singles])),
                       "per_case_neighborhood": [x.neighborhood for x in singles]},
            "together": {"efficacy": tog.efficacy, "paraphrase": tog.paraphrase, "neighborhood": tog.neighborhood,
                         "p_target": tog.p_target, "neighbors_edited": tog.neighbors_edited,
                         "neighbors_undecidable": tog.neighbors_undecidable},
            "seconds": round(time.time() - t0, 1), "load_average": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--value-cache", required=True)
    ap.add_argument("--layers", default="18-22")
    ap.add_argument("--lams", default="1500")
    ap.add_argument("--mus", default="0")
    ap.add_argument("--preserve", default=None)
    ap.add_argument("--out", default="edits_smollm2_tune.json")
    a = ap.parse_args()
    cache_values(Path(a.value_cache))
    c = vindex3.open(default_model.container_path())
    tok = c.tokenizer
    cases = load_cases(ROOT / TUNE)
    base_ex = c.executor()
    known = sum(int(np.argmax(base_ex.forward(tok.encode(cs.prompt))[-1])) == tok.encode(cs.original, special=False)[0]
                for cs in cases)
    dest = ROOT / "bench" / "results" / a.out
    out = json.loads(dest.read_text()) if dest.exists() else {"machine": facts(), "cases_file": TUNE,
                                                              "known": known, "cases": len(cases), "runs": []}
    print(f"the model's own top-1 is the original answer on {known}/{len(cases)} tuning prompts", flush=True)
    for rng in a.layers.split(","):
        lo, _, hi = rng.partition("-")
        layers = list(range(int(lo), int(hi) + 1))
        for lam in [float(x) for x in a.lams.split(",")]:
            for mu in [float(x) for x in a.mus.split(",")]:
                r = run(c, base_ex, cases, layers, lam, mu, a.preserve)
                out["runs"].append(r)
                dest.write_text(json.dumps(out, indent=1) + "\n")
                s, t = r["single"], r["together"]
                print(f"layers {rng} lam {lam:g} mu {mu:g}: single {s['efficacy']:.2f}/{s['paraphrase']:.2f}/"
                      f"{s['neighborhood']:.2f} together {t['efficacy']:.2f}/{t['paraphrase']:.2f}/{t['neighborhood']:.2f} "
                      f"({r['seconds']:.0f} s, load {r['load_average'][0]:.1f})", flush=True)


if __name__ == "__main__":
    main()
