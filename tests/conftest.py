"""Session fixtures: tiny checkpoints and their encoded containers, built once per run."""

from __future__ import annotations

import pytest

from fixtures import FAMILIES, build_checkpoint


def _need_transformers():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover - CI installs them
        pytest.skip(f"SKIPPED LOUDLY: the numerical oracle is not installed ({e}); run scripts/test", allow_module_level=False)


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    """family -> HF checkpoint dir, built lazily."""
    cache: dict = {}
    base = tmp_path_factory.mktemp("ckpt")

    def get(family: str):
        if family not in cache:
            _need_transformers()
            cache[family] = build_checkpoint(family, base / family)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def containers(tmp_path_factory, checkpoint_dirs):
    """family -> encoded container path, built lazily."""
    import vindex3

    cache: dict = {}
    base = tmp_path_factory.mktemp("vx")

    def get(family: str):
        if family not in cache:
            cache[family] = vindex3.encode(checkpoint_dirs(family), base / f"{family}.vindex3")
        return cache[family]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(checkpoint_dirs):
    return checkpoint_dirs("llama")


@pytest.fixture(scope="session")
def tiny_llama_container(containers):
    return containers("llama")


ALL_FAMILIES = sorted(FAMILIES)
