"""Machine facts written next to every benchmark figure."""

from __future__ import annotations

import os
import platform
import sys


def blas_identity() -> str:
    try:
        import numpy as np

        cfg = np.show_config(mode="dicts")
        b = cfg.get("Build Dependencies", {}).get("blas", {})
        return f"{b.get('name', '?')} {b.get('version', '')}".strip()
    except Exception as e:  # noqa: BLE001  (older numpy: any failure means "unknown")
        return f"unknown ({type(e).__name__})"


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


def pin_threads(n: int) -> None:
    """Same thread count for both arms; must run before numpy/torch are imported."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(n)
