"""Shared test configuration and fixtures."""

import gc
import os
import socket

import pytest

# Keep XLA on the CPU and quiet; tests must never need an accelerator.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Compile fast: most of the suite's CPU time is XLA compiling many small programs, and LLVM's
# backend optimizations halve that cost while the programs run once or twice (a test's numbers are
# compared to references with tolerances, which hold at either level). Subprocesses inherit it; the
# ones that set XLA_FLAGS for a device count add to it (``xla_flags``).
FAST_COMPILE = "--xla_backend_optimization_level=0"
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


# Longest modules first: pytest-xdist hands out whole modules in collection order, so the last ones
# to start should be short (otherwise one worker finishes a minute-long trainer module alone).
_HEAVY_FIRST = ("tests/train/test_multihost.py", "tests/train/test_overlap.py", "tests/train/test_step.py",
                "tests/train/test_packed.py", "tests/train/test_compilation.py", "tests/train/", "tests/serve/",
                "tests/models/", "tests/learner/")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return next((i for i, prefix in enumerate(_HEAVY_FIRST) if path.startswith(prefix)), len(_HEAVY_FIRST))

    items.sort(key=rank)  # stable: the order inside a module, and of modules within a rank, is kept


_JAX_CACHE_OPTIONS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                      "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(scope="module", autouse=True)
def _isolate_jax_between_modules():
    """After each module: restore JAX's persistent-cache options (an in-process trainer run turns
    the cache on for the whole process; the next module must not inherit that), then drop the
    module's compiled programs and dead servers' buffers (without this a worker's memory grows
    with every module it runs)."""
    import jax

    saved = {name: getattr(jax.config, name) for name in _JAX_CACHE_OPTIONS}
    yield
    changed = [name for name, value in saved.items() if getattr(jax.config, name) != value]
    for name in changed:
        jax.config.update(name, saved[name])
    if changed:  # JAX keeps the cache it opened until told to forget it
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def tiny():
    """``(model, tokenizer)`` of the tiny preset (one per test module: servers may swap its weights)."""
    from jaxprm.models import load_model

    return load_model("tiny")


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny):
    return tiny[1]


@pytest.fixture
def free_port():
    """``free_port() -> int``: a loopback port with nothing listening on it."""

    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick
