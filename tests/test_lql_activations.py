"""SET activations: the executor choice for int8 and q4 decode products (integer dot products
over per-block int8 activations), named in SHOW SETTINGS, INFER's result and EXPLAIN, and
refused where it cannot run."""

from __future__ import annotations

import lql_fixtures  # noqa: F401
import numpy as np
import pytest

import lql
from lql.errors import SettingError


@pytest.fixture(scope="module")
def int8_container(tiny_llama_container, tmp_path_factory):
    out = tmp_path_factory.mktemp("act") / "int8.vindex3"
    lql.connect(tiny_llama_container).execute(f"REPRESENT INTO '{out}' ENCODING 'int8'")
    return out


def test_activations_is_a_named_setting_recorded_in_results(int8_container):
    s = lql.connect(int8_container)
    exact = s.execute_one("INFER 'The capital of France is' GENERATE 4")
    assert exact.activations == "exact" and "activations" not in exact.to_text()
    s.execute("SET activations = 'q8'")
    q8 = s.execute_one("INFER 'The capital of France is' GENERATE 4")
    assert q8.activations == "q8" and "activations  q8" in q8.to_text(timing=False)
    assert "activations: q8" in s.execute_one("EXPLAIN").to_text()
    # q8 acts on the prompt's prefill too (integer tiles, vindex3.codecs.inttiles): its logits
    # change by the activation quantization, and only by that much
    assert q8.logits.shape == exact.logits.shape and np.isfinite(q8.logits).all()
    assert not np.array_equal(exact.logits, q8.logits)
    # measured on this fixture: max |difference| = 0.0076 of max |logit|; bound 0.05 (6x that)
    assert np.abs(q8.logits - exact.logits).max() <= 0.05 * np.abs(exact.logits).max()
    assert any(r["name"] == "activations" and r["value"] == "q8" for r in s.execute_one("SHOW SETTINGS").to_records())


def test_activations_takes_exact_or_q8_only():
    s = lql.Session()
    with pytest.raises(SettingError, match="activations"):
        s.execute("SET activations = 'q4'")
