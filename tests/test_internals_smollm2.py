"""Looking inside the real model (SmolLM2-135M-Instruct): WALK and DESCRIBE answer within a second
once its feature metadata is built, and DECOMPOSE is exact on it.

The metadata is built into the default model's container (a derived representation is a cache
that lives in the container by design); the first run pays the build (one GEMM per layer, see
bench/internals_smollm2.py for the figures), later runs read it."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

import vindex3
from vindex3.internals import Internals


@pytest.fixture(scope="module")
def smol_ix(smollm2_features):
    ix = Internals(smollm2_features)
    note = ix.build_metadata()
    print(note.describe() or "feature metadata read from the container")
    return ix


def _best(fn, n=3):
    out, r = [], None
    for _ in range(n):
        t0 = time.perf_counter()
        r = fn()
        out.append(time.perf_counter() - t0)
    return min(out), r


@pytest.mark.slow
def test_smollm2_describe_and_walk_answer_within_a_second(smol_ix, smollm2_container):
    cold, _ = _best(lambda: Internals(smollm2_container).describe("France"), 2)  # reads and checks 30 files
    warm_d, d = _best(lambda: smol_ix.describe("France"))
    warm_w, w = _best(lambda: smol_ix.walk("The capital of France is"))
    print(f"DESCRIBE 'France': {warm_d * 1000:.0f} ms (fresh handle {cold * 1000:.0f} ms); "
          f"WALK: {warm_w * 1000:.0f} ms")
    assert warm_d < 1.0 and warm_w < 1.0
    assert d.layers == list(range(30)) and not d.skipped and d.edges
    assert all(e.source == "France" and e.target_id not in d.prompt.ids for e in d.edges)
    assert w.query_token == " is" and len(w.layers) == 30 and all(len(x.features) == 5 for x in w.layers)


@pytest.mark.slow
def test_smollm2_decompose_is_exact_and_the_lens_ends_at_the_output(smol_ix, smollm2_container):
    r = smol_ix.trace("The capital of France is", " Paris", decompose=True)
    d = r.decomposition
    scale = math.fsum(abs(p.logit) for p in d.parts)
    assert d.bound == 1e-5 * scale and abs(d.unexplained) <= d.bound and len(d.parts) == 61
    logits = vindex3.open(smollm2_container).executor().forward(r.prompt.ids)
    assert d.final_logit == float(logits[-1, r.target_id])
    assert r.rows[-1].layer == 29 and r.rows[-1].top_id == int(np.argmax(logits[-1]))
    assert math.isclose(r.rows[-1].logit, float(logits[-1, r.target_id]), rel_tol=1e-5)
