"""The process switches (vindex3.switches): 0 turns a compiled path off, 1 or unset leaves it
on, anything else is refused by name at first use, through the language as a statement's
error and from the command line as a message without a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import lql
from vindex3.errors import ConfigError
from vindex3.exec.ops import decode, fused_layer, prefill_attend
from vindex3.switches import read_switch

SWITCHES = [
    ("VINDEX3_DECODE_KERNELS", decode),
    ("VINDEX3_PREFILL_KERNELS", prefill_attend),
    ("VINDEX3_FUSED_LAYERS", fused_layer),
]


@pytest.fixture()
def fresh_switches():
    """Every switch forgotten before and after, so each test reads the environment it sets."""
    for _, mod in SWITCHES:
        mod.set_enabled(None)
    yield
    for _, mod in SWITCHES:
        mod.set_enabled(None)


@pytest.mark.parametrize("env,mod", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_values_read_from_the_environment(env, mod, monkeypatch, fresh_switches):
    for raw, want in [(None, True), ("", True), ("1", True), ("0", False), (" 0 ", False)]:
        if raw is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, raw)
        mod.set_enabled(None)
        assert mod.enabled() is want, (env, raw)
    mod.set_enabled(True)  # an explicit setting wins over the environment until forgotten
    assert mod.enabled() is True


@pytest.mark.parametrize("raw", ["yes", "off", "2", "true", "O"])
@pytest.mark.parametrize("env,mod", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_other_values_are_refused_by_name(env, mod, raw, monkeypatch, fresh_switches):
    monkeypatch.setenv(env, raw)
    mod.set_enabled(None)
    with pytest.raises(ConfigError) as e:
        mod.enabled()
    assert env in str(e.value) and repr(raw) in str(e.value)
    with pytest.raises(ConfigError):
        read_switch(env)


def test_a_statement_reports_a_bad_switch(tiny_llama_container, monkeypatch, fresh_switches):
    monkeypatch.setenv("VINDEX3_FUSED_LAYERS", "yes")
    fused_layer.set_enabled(None)
    s = lql.Session()
    s.execute(f"OPEN '{tiny_llama_container}'")
    outs = list(s.run("INFER 'hello world' TOP 1;"))
    assert outs[-1].error is not None
    assert "VINDEX3_FUSED_LAYERS='yes'" in str(outs[-1].error)
    monkeypatch.setenv("VINDEX3_FUSED_LAYERS", "1")
    fused_layer.set_enabled(None)
    outs = list(s.run("INFER 'hello world' TOP 1;"))  # the session goes on once the value is mended
    assert outs[-1].error is None


def test_the_cli_prints_a_message_not_a_traceback(tiny_llama_container):
    env = dict(os.environ, VINDEX3_DECODE_KERNELS="on")
    p = subprocess.run([sys.executable, "-m", "lql", "-e", f"OPEN '{tiny_llama_container}'; INFER 'hello' TOP 1;"],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    text = p.stdout + p.stderr
    assert p.returncode != 0
    assert "VINDEX3_DECODE_KERNELS='on'" in text
    assert "Traceback" not in text


def test_an_unknown_vindex3_variable_is_refused_with_the_nearest_name(monkeypatch):
    from vindex3.switches import KNOWN, check_all

    for k in [k for k in os.environ if k.startswith("VINDEX3_") and k not in KNOWN]:
        monkeypatch.delenv(k)
    check_all()  # the known names (unset or valid) pass
    monkeypatch.setenv("VINDEX3_FUSED_LAYER", "0")
    with pytest.raises(ConfigError) as e:
        check_all()
    assert "VINDEX3_FUSED_LAYER" in str(e.value) and "did you mean VINDEX3_FUSED_LAYERS?" in str(e.value)
