"""Machine facts written next to every benchmark figure."""

from __future__ import annotations

import os
import platform
import sys

# The caller's OpenMP wait settings, read when a bench imports this module, before anything imports
# vindex3 (vindex3.codecs.threads sets both for itself when OMP_WAIT_POLICY is unset): a peer
# engine's arms run with the caller's settings, not ours (ggml's OpenMP barriers slow down 3-4x at
# 2 threads when its workers sleep).
USER_OMP = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def peer_omp_env(env: dict) -> dict:
    """``env`` with the caller's own OpenMP wait settings in place of any vindex3 set for itself."""
    for k, v in USER_OMP.items():
        env.pop(k, None)
        if v is not None:
            env[k] = v
    return env


def omp_labels() -> dict:
    """How our arms' and the peer's OpenMP workers wait, for a bench's JSON."""
    w, spin = USER_OMP["OMP_WAIT_POLICY"], USER_OMP["GOMP_SPINCOUNT"]
    if w:
        ours = w + (f", GOMP_SPINCOUNT={spin}" if spin else "")
    else:
        from vindex3.codecs.threads import SPIN_COUNT

        ours = f"PASSIVE, GOMP_SPINCOUNT={spin or SPIN_COUNT} (vindex3.codecs.threads default)"
    peer = (w or "unset (libgomp default)") + (f", GOMP_SPINCOUNT={spin}" if spin else "")
    return {"ours": ours, "llama.cpp": peer}


def blas_identity() -> str:
    try:
        import numpy as np

        cfg = np.show_config(mode="dicts")
        b = cfg.get("Build Dependencies", {}).get("blas", {})
        return f"{b.get('name', '?')} {b.get('version', '')}".strip()
    except Exception as e:  # noqa: BLE001  (older numpy: any failure means "unknown")
        return f"unknown ({type(e).__name__})"


def blas_kernel() -> str | None:
    """The core type OpenBLAS chose (threadpoolctl's 'architecture'), or None."""
    try:
        from threadpoolctl import threadpool_info

        return next((i.get("architecture") for i in threadpool_info() if i.get("internal_api") == "openblas"), None)
    except Exception:  # noqa: BLE001  (no threadpoolctl, or an unknown library: not known)
        return None


def facts(threads: int | None = None) -> dict:
    import numpy as np

    d = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "numpy": np.__version__,
        "blas": blas_identity(),
        "threads": threads,
        # which kernel OpenBLAS runs, and the variables that choose it (some machines set
        # OPENBLAS_CORETYPE for old OpenBLAS builds; a current one is slower under it)
        "blas_kernel": blas_kernel(),
        "openblas_env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_THREAD_TIMEOUT")},
    }
    try:
        import torch

        d["torch"] = torch.__version__
        d["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    try:
        import transformers

        d["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        d["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return d


def child_json(cmd: list[str], env: dict, what: str, timeout: float = 1800) -> dict:
    """Run one bench arm in its own process and return the JSON object its last stdout line
    holds; a failed arm stops the bench with its name and the end of its stderr."""
    import json
    import subprocess

    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode:
        raise SystemExit(f"arm {what} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def pin_threads(n: int) -> None:
    """Same thread count for both arms; must run before numpy/torch are imported."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(n)
