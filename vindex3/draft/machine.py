"""Machine facts that travel with every dump and benchmark: which numpy, which BLAS, how many
threads. A figure without these cannot be compared with another figure."""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from functools import lru_cache
from importlib import metadata
from typing import Any

import numpy as np

# Environment variables that cap BLAS/OpenMP threads; recorded verbatim when set.
_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
               "VINDEX3_DECODE_THREADS")


def library_version() -> str:
    """The installed version of this project, or the source tree's when run uninstalled."""
    try:
        return metadata.version("lql-vindex3")
    except metadata.PackageNotFoundError:
        try:
            import vindex3

            return vindex3.__version__
        except Exception:  # noqa: BLE001 - a version string is never worth a crash
            return "unknown"


@lru_cache(maxsize=1)
def _blas_build() -> dict[str, Any]:
    try:
        deps = np.show_config(mode="dicts").get("Build Dependencies", {})
    except Exception:  # noqa: BLE001 - older numpy prints instead of returning
        return {}
    blas = deps.get("blas", {}) or {}
    return {
        "name": blas.get("name"),
        "version": blas.get("version"),
        "config": blas.get("openblas configuration"),
    }


def _openblas_threads() -> int | None:
    """Ask the OpenBLAS that numpy actually loaded how many threads it runs, if it is OpenBLAS."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            libs = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None
    for lib_path in sorted(libs):
        try:
            lib = ctypes.CDLL(lib_path)
        except OSError:
            continue
        for sym in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                    "openblas_get_num_threads"):
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return int(fn())
    return None


def blas_identity() -> dict[str, Any]:
    """numpy's BLAS: name, version, build configuration and the thread count in effect."""
    out = dict(_blas_build())
    out["threads"] = _openblas_threads()
    return out


def thread_count() -> int | None:
    """The BLAS thread count in effect (what the matmuls use), when it can be asked."""
    return _openblas_threads()


def _decode_threads() -> int | None:
    from .slices import decode_thread_count

    return decode_thread_count()


def machine_facts() -> dict[str, Any]:
    """Everything a benchmark figure needs beside it to be comparable."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "numpy": np.__version__,
        "blas": blas_identity(),
        "thread_count": thread_count(),
        "decode_thread_count": _decode_threads(),
        "thread_env": {k: os.environ[k] for k in _THREAD_ENV if k in os.environ},
        # Other processes competing for the cores change every timing; record how busy it was.
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "library_version": library_version(),
    }
