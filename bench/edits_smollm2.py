"""Knowledge edits on SmolLM2-135M-Instruct: the 20 counterfactual edits of tests/data/edits_smollm2.jsonl
(facts the model knows: its own top-1 at each prompt is the original answer, checked first), each mode
single (one edit on the unedited model) and all 20 together, scored with CounterFact's metrics
(vindex3.edits.score). Writes bench/results/edits_smollm2.json with the machine facts.

    python bench/edits_smollm2.py [--modes memit,compose,knn] [--single-kl 5]
"""

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

from machine import facts

import vindex3
from vindex3 import default_model
from vindex3.edits import EditedModel, FitSettings, Patch
from vindex3.edits.fit import make_edits, request
from vindex3.edits.score import load_cases, score


def summary(r) -> dict:
    return {"efficacy": r.efficacy, "paraphrase": r.paraphrase, "neighborhood": r.neighborhood,
            "p_target": r.p_target, "kl": r.kl, "kl_positions": r.kl_positions}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="memit,compose,knn")
    ap.add_argument("--single-kl", type=int, default=2, help="single edits whose prompt-bank KL is measured")
    ap.add_argument("--layers", default=None, help="a-b for MEMIT, n for the others")
    ap.add_argument("--out", default="edits_smollm2.json", help="file name under bench/results")
    a = ap.parse_args()
    c = vindex3.open(default_model.container_path())
    tok = c.tokenizer
    cases = load_cases(ROOT / "tests" / "data" / "edits_smollm2.jsonl")
    base_ex = c.executor()
    known = []
    for cs in cases:
        top = int(np.argmax(base_ex.forward(tok.encode(cs.prompt))[-1]))
        known.append(top == tok.encode(cs.original, special=False)[0])
    print(f"the model's own top-1 is the original answer on {sum(known)}/{len(cases)} prompts", flush=True)
    unedited = score(c, c, cases, kl=False, executor=base_ex)
    out = {"machine": facts(), "load_average": os.getloadavg(), "known": sum(known), "cases": len(cases),
           "unedited": summary(unedited), "modes": {}}
    settings = FitSettings()
    for mode in a.modes.split(","):
        layers = None
        if a.layers:
            lo, _, hi = a.layers.partition("-")
            layers = list(range(int(lo), int(hi or lo) + 1))
        t0 = time.time()
        singles = []
        for i, cs in enumerate(cases):
            p = Patch(name=f"single-{i}", base_digest=c.digest, base_name=c.name)
            make_edits(c, p, [request(c, cs.prompt, cs.target)], mode, layers, settings)
            m = EditedModel(c, [p])
            r = score(c, m, [cs], kl=i < a.single_kl, base_executor=base_ex)
            singles.append(r)
            print(f"{mode} single {i}: eff {r.efficacy:.0f} para {r.paraphrase:.2f} nb {r.neighborhood:.2f} "
                  f"p {r.p_target:.3f} kl {r.kl}", flush=True)
        t_single = time.time() - t0
        t0 = time.time()
        p = Patch(name="all", base_digest=c.digest, base_name=c.name)
        make_edits(c, p, [request(c, cs.prompt, cs.target) for cs in cases], mode, layers, settings)
        m = EditedModel(c, [p])
        together = score(c, m, cases, base_executor=base_ex)
        t_all = time.time() - t0
        kls = [r.kl for r in singles if r.kl is not None]
        out["modes"][mode] = {
            "layers": p.edits[0].layers, "label": p.edits[0].label,
            "single": {"efficacy": float(np.mean([r.efficacy for r in singles])),
                       "paraphrase": float(np.mean([r.paraphrase for r in singles])),
                       "neighborhood": float(np.mean([r.neighborhood for r in singles])),
                       "p_target": float(np.mean([r.p_target for r in singles])),
                       "kl_mean_first": len(kls), "kl": float(np.mean(kls)) if kls else None, "seconds": t_single},
            "together": {**summary(together), "seconds": t_all,
                         "per_case": [cs.model_dump() for cs in together.cases]},
        }
        print(mode, json.dumps({k: v for k, v in out["modes"][mode].items() if k != "together"}),
              json.dumps(summary(together)), flush=True)
    out["load_average_end"] = os.getloadavg()
    dest = ROOT / "bench" / "results" / a.out
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", dest)


if __name__ == "__main__":
    main()
