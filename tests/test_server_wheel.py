"""The wheel as a user installs it: built from this tree (`pip wheel --no-deps`, the build
backend already in the environment, no download), installed into a fresh venv (`--no-deps`; its dependencies are this environment's: the
venv is made with --system-site-packages, and since the tests themselves run inside a venv,
whose packages are not the system's, a .pth line appends this environment's site-packages after
the new venv's own, so the installed wheel comes first), and run from outside the
source tree -- `lql --help`, `lql serve --help`, `lql -e` on a container (and on the default
model when it is cached here), a script importing the installed packages. Skipped loudly
where the build backend or venv's pip is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def test_the_wheel_installs_into_a_fresh_venv_and_runs_from_outside_the_tree(tmp_path, tiny_llama_container):
    wheels = tmp_path / "wheels"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(wheels)], capture_output=True, text=True, timeout=300, check=False)
    if p.returncode and "No module named" in p.stderr:
        pytest.skip(f"SKIPPED LOUDLY: the build backend (setuptools, wheel) is not installed here: {p.stderr[-300:]}")
    assert p.returncode == 0, p.stderr
    (wheel,) = wheels.glob("lql_vindex3-*.whl")

    venv = tmp_path / "venv"
    p = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], capture_output=True,
                       text=True, timeout=300, check=False)
    if p.returncode:
        pytest.skip(f"SKIPPED LOUDLY: cannot create a venv here: {p.stderr[-300:]}")
    py = venv / "bin" / "python"
    import site
    import sysconfig

    theirs = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path,
                       dict(os.environ)).stdout.strip())
    ours = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]} if Path(p).is_dir()]
    (theirs / "_outer_environment.pth").write_text("".join(f"{p}\n" for p in ours), encoding="utf-8")
    lql_bin = venv / "bin" / "lql"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    # no PYTHONPATH pointing into the source tree: the installed wheel is what runs
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    p = _run([str(py), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], outside, env)
    if p.returncode and "No module named pip" in p.stderr:
        pytest.skip("SKIPPED LOUDLY: the fresh venv has no pip (ensurepip is missing here)")
    assert p.returncode == 0, p.stderr

    p = _run([str(py), "-c", "import lql, vindex3, lql.server.app; print(lql.__file__); print(vindex3.__file__)"],
             outside, env)
    assert p.returncode == 0, p.stderr
    for line in p.stdout.split():
        assert str(venv) in line and str(ROOT) not in line, line  # the installed copy, not the tree

    p = _run([str(lql_bin), "--help"], outside, env)
    assert p.returncode == 0 and "usage" in p.stdout.lower(), p.stderr
    p = _run([str(lql_bin), "serve", "--help"], outside, env)
    assert p.returncode == 0 and "--cors-origin" in p.stdout, p.stderr
    p = _run([str(lql_bin), "-e", f"OPEN '{tiny_llama_container}'; STATS;"], outside, env)
    assert p.returncode == 0, p.stderr
    assert "layers" in p.stdout

    from vindex3 import default_model

    if (default_model.container_path() / "index.json").exists():
        p = _run([str(lql_bin), "-t", "--format", "csv", "-e", "OPEN DEFAULT; SHOW LAYERS;"], outside, env)
        assert p.returncode == 0, p.stderr
        assert len(p.stdout.strip().splitlines()) == 30  # SmolLM2's 30 layers, one row each
    else:
        print("SKIPPED LOUDLY (part): the default model is not cached here, so OPEN DEFAULT was not run from the wheel")
