"""Knowledge edits on SmolLM2-135M-Instruct: the 20 counterfactual edits of tests/data/edits_smollm2.jsonl
(facts the model knows: its own top-1 at each prompt is the original answer, checked first), each mode
single (one edit on the unedited model) and all 20 together, scored with CounterFact's metrics
(vindex3.edits.score). Writes bench/results/edits_smollm2.json with the machine facts.

    python bench/edits_smollm2.py [--modes memit,compose,knn] [--single-kl 5] [--key subject|last-token]
        [--cases FILE] [--preserve FILE --preserve-weight MU] [--value-cache DIR] [--fit-values-only]

MODE MEMIT keys at each line's subject (its last token) unless --key last-token. With --value-cache,
MEMIT's fitted values (`fit.fit_value`, the costly part: they depend on the prompt, the target, the
subject, the value's layer, the context prefixes and the value-fit settings, nothing else) are kept
on disk under that key and reused, so runs that vary only the closed form (lambda, the range's
lower layers, preservation) refit nothing.
"""

from __future__ import annotations

import argparse
import hashlib
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
from vindex3.edits import fit as fitmod
from vindex3.edits.fit import context_prefixes, make_edits, request
from vindex3.edits.score import load_cases, score
from vindex3.exec.slice import Draft

VALUE_FIELDS = ("contexts", "context_tokens", "v_steps", "v_lr", "v_clamp", "v_kl", "v_decay", "v_stop")


def cache_values(directory: Path) -> None:
    """Route `fit.fit_value` through a disk cache in ``directory`` (fits on a bare container only:
    the key holds its digest, the request, the layer, the contexts and the value settings)."""
    directory.mkdir(parents=True, exist_ok=True)
    real = fitmod.fit_value

    def cached(model, r, layer, settings, contexts):
        if isinstance(model, EditedModel):
            return real(model, r, layer, settings, contexts)
        key = json.dumps([model.digest, r.prompt, r.target_id, r.entity, layer, list(contexts),
                          [getattr(settings, k) for k in VALUE_FIELDS]])
        f = directory / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".npz")
        if f.exists():
            z = np.load(f)
            return z["h"], z["delta"], json.loads(str(z["fig"]))
        h, d, fig = real(model, r, layer, settings, contexts)
        tmp = f.with_suffix(".tmp.npz")
        np.savez(tmp, h=h, delta=d, fig=json.dumps(fig))
        os.replace(tmp, f)
        return h, d, fig

    fitmod.fit_value = cached


def summary(r) -> dict:
    return {"efficacy": r.efficacy, "paraphrase": r.paraphrase, "neighborhood": r.neighborhood,
            "p_target": r.p_target, "kl": r.kl, "kl_positions": r.kl_positions}


def merge(parts: list[str], dest: Path) -> None:
    """One result file from several runs over parts of the singles (run side by side), the
    together figures from whichever part has them; the single figures recomputed over all cases."""
    runs = [json.loads((ROOT / "bench" / "results" / f).read_text()) for f in parts]
    out = {**runs[0], "parts": parts, "load_averages": [r["load_average"] for r in runs]}
    for mode in runs[0]["modes"]:
        res = {}
        per, fits, secs = [], [], 0.0
        for r in runs:
            m = r["modes"][mode]
            res.update({k: v for k, v in m.items() if k not in ("single",) and v is not None})
            if "single" in m:
                per += m["single"]["per_case"]
                fits += m["single"]["fits"]
                secs += m["single"]["seconds"]
        if per:
            kls = [c["kl"] for c in per if c.get("kl") is not None]
            res["single"] = {"efficacy": float(np.mean([c["efficacy"] for c in per])),
                             "paraphrase": float(np.mean([c["paraphrase"] for c in per])),
                             "neighborhood": float(np.mean([c["neighborhood"] for c in per])),
                             "p_target": float(np.mean([c["p_target"] for c in per])), "cases": len(per),
                             "kl_mean_first": len(kls), "kl": float(np.mean(kls)) if kls else None,
                             "seconds_summed": secs, "per_case": per, "fits": fits}
        out["modes"][mode] = res
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", dest)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="memit,compose,knn")
    ap.add_argument("--single-kl", type=int, default=2, help="single edits whose prompt-bank KL is measured")
    ap.add_argument("--layers", default=None, help="a-b for MEMIT, n for the others")
    ap.add_argument("--out", default="edits_smollm2.json", help="file name under bench/results")
    ap.add_argument("--key", default="subject", help="MEMIT's key: subject or last-token")
    ap.add_argument("--lam", type=float, default=None, help="MEMIT's covariance weight for this key")
    ap.add_argument("--singles", default="0-19", help="a-b: the cases fitted one at a time; none: no single edits")
    ap.add_argument("--no-together", dest="together", action="store_false", help="skip the 20 fitted together")
    ap.add_argument("--merge", nargs="+", default=None, help="combine result files of parts of the singles into --out")
    ap.add_argument("--cases", default="tests/data/edits_smollm2.jsonl", help="the edits file (under the repository)")
    ap.add_argument("--value-cache", default=None, help="a directory keeping MEMIT's fitted values between runs")
    ap.add_argument("--preserve", default=None, help="MEMIT's preservation corpus (a JSONL of {prompt, subject})")
    ap.add_argument("--preserve-weight", type=float, default=0.0, help="MEMIT's weight per preservation key")
    ap.add_argument("--fit-values-only", action="store_true", help="fit (and cache) the MEMIT values of the singles, no scoring")
    ap.add_argument("--container", default=None, help="a container to edit (a representation of SmolLM2, say); "
                    "default the built-in model")
    ap.add_argument("--depth", type=int, default=None, help="score Draft(depth) of the edited and of the base model "
                    "(the edits are fitted on the full model, as INSERT fits them)")
    a = ap.parse_args()
    if a.value_cache:
        cache_values(Path(a.value_cache))
    if a.merge:
        merge(a.merge, ROOT / "bench" / "results" / a.out)
        return
    c = vindex3.open(a.container or default_model.container_path())
    tok = c.tokenizer
    cases = load_cases(ROOT / a.cases)
    sl = Draft(a.depth) if a.depth is not None else None

    def scored(model):  # the executor SCORE EDITS runs under the session's DRAFT DEPTH (or the full model)
        return model.executor(slice=sl)

    base_ex = scored(c)
    known = []
    for cs in cases:
        top = int(np.argmax(base_ex.forward(tok.encode(cs.prompt))[-1]))
        known.append(top == tok.encode(cs.original, special=False)[0])
    print(f"the model's own top-1 is the original answer on {sum(known)}/{len(cases)} prompts", flush=True)
    unedited = score(c, c, cases, kl=False, executor=base_ex)
    out = {"machine": facts(), "load_average": os.getloadavg(), "known": sum(known), "cases": len(cases),
           "container": Path(a.container).name if a.container else "the built-in model", "depth": a.depth,
           "unedited": summary(unedited), "modes": {}}
    settings = FitSettings(key=a.key, preserve=str(ROOT / a.preserve) if a.preserve else None,
                           preserve_weight=a.preserve_weight)
    if a.lam is not None:
        setattr(settings, "lam_subject" if a.key == "subject" else "lam", a.lam)
    out["settings"] = {**settings.record(), **settings.value_record(),
                       "preserve": a.preserve, "preserve_weight": a.preserve_weight if a.preserve else None}
    out["cases_file"] = a.cases
    lo_, _, hi_ = a.singles.partition("-")
    picked = [] if a.singles == "none" else list(range(int(lo_), int(hi_ or lo_) + 1))
    if a.fit_values_only:
        lo, _, hi = (a.layers or "").partition("-")
        top = int(hi or lo) if a.layers else fitmod.default_layers(len(c.op_plan().layers), "memit")[-1]
        ctx = context_prefixes(c, settings)
        for i in picked:
            t0 = time.time()
            cs = cases[i]
            fitmod.fit_value(c, request(c, cs.prompt, cs.target, cs.subject), top, settings, ctx)
            print(f"value {i} at layer {top}: {time.time() - t0:.0f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        return
    out["singles_run"] = picked
    for mode in a.modes.split(","):
        layers = None
        if a.layers:
            lo, _, hi = a.layers.partition("-")
            layers = list(range(int(lo), int(hi or lo) + 1))
        t0 = time.time()
        singles = []
        fitted = []
        for i in picked:
            cs = cases[i]
            p = Patch(name=f"single-{i}", base_digest=c.digest, base_name=c.name)
            make_edits(c, p, [request(c, cs.prompt, cs.target, cs.subject)], mode, layers, settings)
            fitted.append(p.edits[0])
            m = EditedModel(c, [p])
            r = score(c, m, [cs], kl=i - picked[0] < a.single_kl, executor=scored(m), base_executor=base_ex)
            singles.append(r)
            print(f"{mode} single {i}: eff {r.efficacy:.0f} para {r.paraphrase:.2f} nb {r.neighborhood:.2f} "
                  f"p {r.p_target:.3f} kl {r.kl}", flush=True)
        t_single = time.time() - t0
        res = out["modes"][mode] = {"layers": None, "label": None}
        if singles:
            kls = [r.kl for r in singles if r.kl is not None]
            res.update(layers=fitted[0].layers, label=fitted[0].label)
            res["single"] = {
                "efficacy": float(np.mean([r.efficacy for r in singles])),
                "paraphrase": float(np.mean([r.paraphrase for r in singles])),
                "neighborhood": float(np.mean([r.neighborhood for r in singles])),
                "p_target": float(np.mean([r.p_target for r in singles])),
                "kl_mean_first": len(kls), "kl": float(np.mean(kls)) if kls else None, "seconds": t_single,
                "per_case": [r.cases[0].model_dump() | {"kl": r.kl} for r in singles],
                "fits": [{k: v for k, v in e.fit.items() if k not in ("covariance", "settings", "value_fit")}
                         for e in fitted]}
            print(mode, json.dumps({k: v for k, v in res["single"].items() if k not in ("per_case", "fits")}), flush=True)
        if a.together:
            t0 = time.time()
            p = Patch(name="all", base_digest=c.digest, base_name=c.name)
            make_edits(c, p, [request(c, cs.prompt, cs.target, cs.subject) for cs in cases], mode, layers, settings)
            m = EditedModel(c, [p])
            together = score(c, m, cases, executor=scored(m), base_executor=base_ex)
            res.update(layers=p.edits[0].layers, label=p.edits[0].label)
            res["together"] = {**summary(together), "seconds": time.time() - t0,
                               "per_case": [cs.model_dump() for cs in together.cases],
                               "fits": [{k: v for k, v in e.fit.items() if k not in ("covariance", "settings", "value_fit")}
                                        for e in p.edits]}
            print(mode, "together", json.dumps(summary(together)), flush=True)
    out["load_average_end"] = os.getloadavg()
    dest = ROOT / "bench" / "results" / a.out
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", dest)


if __name__ == "__main__":
    main()
