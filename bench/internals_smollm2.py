"""Looking inside SmolLM2-135M-Instruct: what feature metadata costs to build, and how fast WALK,
DESCRIBE and TRACE answer once it exists.

* Feature metadata, whole model (30 FFN layers, 1,536 features each, vocabulary 49,152, top 10),
  built into a private copy of the container (segments copied), so it is always a fresh
  build; beside it, in the same process, the plain numpy peer for one layer: one GEMM
  ``W_head @ (γ ⊙ down)`` and an ``argpartition`` top-k, so the ratio says how close the build
  is to the bare GEMM it is made of.
* DESCRIBE 'France', WALK 'The capital of France is' and TRACE ... FOR ' Paris' DECOMPOSE: cold
  (a fresh handle that reads and checks the metadata files) and warm (best of repeats); then the
  same three as LQL statements in one session (parse, plan, the call, the result; and DESCRIBE
  with its text rendering).

Writes bench/results/internals_smollm2.json with machine facts.

    python bench/internals_smollm2.py [--container DIR] [--repeats 5]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vindex3 import jsonio
from vindex3.draft.machine import machine_facts
from vindex3.internals import Internals


def private_copy(src: Path, dst: Path) -> Path:
    """The container's files, copied (a container refuses segments that are symlinks out of it,
    and a hard link would change the source files' ctime, which open sessions of the source
    read as "modified on disk" and refuse); metadata is written into the copy, never into the
    source."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name == "derived":
            continue
        if f.is_dir():
            (dst / f.name).mkdir()
            for g in f.iterdir():
                shutil.copy2(g, dst / f.name / g.name)
        else:
            shutil.copy2(f, dst / f.name)
    index = jsonio.load(dst / "index.json")
    if index.pop("derived", None) is not None:  # the copy starts without derived data (the index resealed)
        from vindex3.manifest import seal

        jsonio.write_atomic(dst / "index.json", seal(index) if "index_sha256" in index else index)
    return dst


def peer_layer(ix: Internals, layer: int, k: int) -> dict:
    """The bare GEMM of one layer, and the same with numpy's argpartition top-k after it."""
    f = ix.view.ffn_layer(layer)
    ro = ix.view.readout
    head = ro.head.dense()
    t0 = time.perf_counter()
    logits = (ro.norm_weight[:, None] * f.view.values).T @ head.T  # [features, vocab]
    t1 = time.perf_counter()
    part = np.argpartition(-logits, k, axis=1)[:, :k]
    np.take_along_axis(logits, part, axis=1)
    return {"gemm": t1 - t0, "gemm_and_argpartition": time.perf_counter() - t0}


def best(fn, repeats):
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = fn()
        out.append(time.perf_counter() - t0)
    return min(out), r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--container")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "internals_smollm2.json"))
    a = ap.parse_args()
    if a.container:
        src = Path(a.container)
    else:
        from vindex3 import default_model

        src = Path(default_model.ensure())
    with tempfile.TemporaryDirectory(dir=src.parent) as tmp:  # beside the source
        path = private_copy(src, Path(tmp) / src.name)
        ix = Internals(path)
        n_ffn = len(ix.view.ffn_layers(None, "bench")[0])
        facts_before = machine_facts()
        peer = peer_layer(ix, 15, ix.metadata.k)
        t0 = time.perf_counter()
        note = ix.build_metadata()
        build = time.perf_counter() - t0
        per_layer = [v["seconds"] for _, v in sorted(ix.container.index["derived"]["feature_tokens"]["layers"].items())]
        peer_after = peer_layer(ix, 15, ix.metadata.k)

        t0 = time.perf_counter()
        cold = Internals(path)
        d = cold.describe("France")
        describe_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        cold2 = Internals(path)
        w = cold2.walk("The capital of France is")
        walk_cold = time.perf_counter() - t0
        describe_warm, d = best(lambda: cold.describe("France"), a.repeats)
        walk_warm, w = best(lambda: cold2.walk("The capital of France is"), a.repeats)
        trace_warm, tr = best(lambda: cold.trace("The capital of France is", " Paris", decompose=True), a.repeats)
        dec = tr.decomposition
        # the same questions as LQL statements (parse, plan, the API call, the result), in one session
        import lql

        t0 = time.perf_counter()
        session = lql.connect(path)
        session.execute_one("DESCRIBE 'France'")
        lql_describe_cold = time.perf_counter() - t0
        lql_describe, _ = best(lambda: session.execute_one("DESCRIBE 'France'"), a.repeats)
        lql_walk, _ = best(lambda: session.execute_one("WALK 'The capital of France is'"), a.repeats)
        lql_trace, _ = best(lambda: session.execute_one("TRACE 'The capital of France is' FOR ' Paris' DECOMPOSE"),
                            a.repeats)
        lql_text, _ = best(lambda: session.execute_one("DESCRIBE 'France'").to_text(), a.repeats)
        top_parts = sorted(dec.parts, key=lambda p: -abs(p.logit))[:5]
        result = {
            "container": src.name,
            "ffn_layers": n_ffn,
            "features_per_layer": ix.view.ffn_layer(0).count,
            "vocab": ix.view.plan.vocab,
            "k": ix.metadata.k,
            "metadata_build_seconds": build,
            "metadata_build_per_layer_seconds": per_layer,
            "peer_one_layer_seconds": [peer, peer_after],
            "build_per_layer_over_bare_gemm": (build / n_ffn) / min(peer["gemm"], peer_after["gemm"]),
            "build_per_layer_over_gemm_and_argpartition": (build / n_ffn) / min(peer["gemm_and_argpartition"],
                                                                                 peer_after["gemm_and_argpartition"]),
            "metadata_bytes": sum(r.bytes for r in ix.container.derived),
            "describe_france_cold_seconds": describe_cold,
            "describe_france_warm_seconds": describe_warm,
            "walk_capital_cold_seconds": walk_cold,
            "walk_capital_warm_seconds": walk_warm,
            "trace_paris_decompose_warm_seconds": trace_warm,
            "lql_describe_france_first_in_session_seconds": lql_describe_cold,
            "lql_describe_france_warm_seconds": lql_describe,
            "lql_walk_capital_warm_seconds": lql_walk,
            "lql_trace_paris_decompose_warm_seconds": lql_trace,
            "lql_describe_france_with_text_warm_seconds": lql_text,
            "example": {
                "describe_france": [f"{e.source} -> {e.target!r} (best gate {e.best_score:.2f} at L{e.best_layer}:"
                                    f"{e.best_feature}, layers {e.first_layer}-{e.last_layer}, {e.count} feature(s))"
                                    for e in d.edges[:5]],
                "describe_passing": d.passing,
                "walk_last_layers": [{"layer": lay.layer, "features": [(h.feature, round(h.score, 2),
                                                                          [t.text for t in h.tokens]) for h in lay.features[:3]]}
                                     for lay in w.layers[-3:]],
                "trace_paris": {"final_logit": dec.final_logit, "sum_of_parts": dec.sum_of_parts,
                                "unexplained": dec.unexplained, "final_prob": tr.final.prob, "final_rank": tr.final.rank,
                                "top_parts": [(p.name, round(p.logit, 3), round(p.share, 3)) for p in top_parts]},
            },
            "note": note.describe(),
            "machine_before": facts_before,
            "machine": machine_facts(),
        }
    Path(a.out).write_text(jsonio.dumps(result) + "\n")
    print(jsonio.dumps({k: v for k, v in result.items() if not k.startswith("machine")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
