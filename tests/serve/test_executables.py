"""The store of compiled programs (``jaxprm.serve.executables``): once per key in a process, loaded
from disk by a later process without tracing, keyed by everything a program depends on, and an
unreadable file compiled again. The engine end to end: a second process loads every program it
needs from the store, traces none, and samples the same tokens and log-probs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprm.serve import executables

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty store in ``tmp_path`` and an empty memory table (restored after the test)."""
    monkeypatch.setattr(executables, "store_dir", lambda: tmp_path / "store")
    monkeypatch.setattr(executables, "_memory", {})
    monkeypatch.setattr(executables, "_pruned", set())
    return tmp_path / "store"


def _lowering(fn, shape, calls):
    def lower():
        calls.append(shape)
        return jax.jit(fn).lower(jax.ShapeDtypeStruct(shape, jnp.float32))
    return lower


@pytest.fixture
def events():
    """The ``jax.monitoring`` events recorded during the test, as ``(name, fun_name)``."""
    seen: list = []

    def listen(name, **kw):
        seen.append((name, kw.get("fun_name")))

    jax.monitoring.register_event_listener(listen)
    yield seen
    jax.monitoring.unregister_event_listener(listen)


def test_a_program_is_compiled_once_then_loaded_from_disk(store, monkeypatch, events):
    fn = lambda x: jnp.tanh(x) * 3.0 + 1.0  # noqa: E731
    calls: list = []
    first = executables.load_or_compile("tanh3", ((5,),), _lowering(fn, (5,), calls))
    assert executables.load_or_compile("tanh3", ((5,),), _lowering(fn, (5,), calls)) is first  # memory
    assert calls == [(5,)] and len(list(store.glob("*/tanh3-*.pkl"))) == 1

    monkeypatch.setattr(executables, "_memory", {})  # a new process: the disk only
    loaded = executables.load_or_compile("tanh3", ((5,),), _lowering(fn, (5,), calls))
    assert calls == [(5,)]  # not traced, not lowered, not compiled
    assert (executables.HIT_EVENT, "tanh3") in events
    x = jnp.linspace(-2.0, 2.0, 5)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(first(x)))

    # another signature is another program
    executables.load_or_compile("tanh3", ((7,),), _lowering(fn, (7,), calls))
    assert calls == [(5,), (7,)] and len(list(store.glob("*/tanh3-*.pkl"))) == 2


def test_an_unreadable_file_is_compiled_again_and_overwritten(store, monkeypatch):
    fn = lambda x: x * 2.0 - 9.0  # noqa: E731
    calls: list = []
    executables.load_or_compile("lin", ((4,),), _lowering(fn, (4,), calls))
    (path,) = store.glob("*/lin-*.pkl")
    path.write_bytes(b"not a pickle")
    monkeypatch.setattr(executables, "_memory", {})
    again = executables.load_or_compile("lin", ((4,),), _lowering(fn, (4,), calls))
    assert calls == [(4,), (4,)]
    np.testing.assert_array_equal(np.asarray(again(jnp.ones(4))), np.full(4, -7.0))
    monkeypatch.setattr(executables, "_memory", {})
    executables.load_or_compile("lin", ((4,),), _lowering(fn, (4,), calls))
    assert calls == [(4,), (4,)]  # the overwritten file loads


def test_a_code_or_runtime_change_never_loads_a_stale_program(store, monkeypatch):
    fn = lambda x: x + 1.0  # noqa: E731
    calls: list = []
    executables.load_or_compile("inc", ((3,),), _lowering(fn, (3,), calls))
    monkeypatch.setattr(executables, "_memory", {})
    executables._environment.cache_clear()
    monkeypatch.setattr(executables, "_source_hash", lambda: "edited")
    try:
        executables.load_or_compile("inc", ((3,),), _lowering(fn, (3,), calls))
    finally:
        executables._environment.cache_clear()
    assert calls == [(3,), (3,)] and len(list(store.glob("*/inc-*.pkl"))) == 2


def test_the_folders_of_old_environments_are_pruned(store):
    import os

    for i in range(6):
        old = store / f"old{i}"
        old.mkdir(parents=True)
        (old / "x.pkl").write_bytes(b"")
        os.utime(old, (1000.0 + i, 1000.0 + i))  # old1 .. old5 by age; old5 the newest
    executables.load_or_compile("sq", ((3,),), _lowering(jnp.square, (3,), []))
    kept = {d.name for d in store.iterdir()}
    here = kept - {"old3", "old4", "old5"}
    assert len(kept) == executables.KEEP_ENVIRONMENTS and len(here) == 1
    assert list((store / here.pop()).glob("sq-*.pkl"))


def test_without_the_persistent_cache_programs_stay_in_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(executables, "_memory", {})
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert executables.store_dir() is None
        calls: list = []
        executables.load_or_compile("neg", ((2,),), _lowering(jnp.negative, (2,), calls))
        executables.load_or_compile("neg", ((2,),), _lowering(jnp.negative, (2,), calls))
        assert calls == [(2,)]
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_abstract_signatures_name_structure_shapes_dtypes_and_shardings():
    sig = executables.abstract_signature
    a = {"w": jnp.zeros((2, 3)), "b": np.zeros(3, np.float32)}
    assert sig(a) == sig({"w": jnp.ones((2, 3)), "b": np.ones(3, np.float32)})  # values do not matter
    assert sig(a) != sig({"w": jnp.zeros((2, 4)), "b": np.zeros(3, np.float32)})
    assert sig(a) != sig({"w": jnp.zeros((2, 3), jnp.bfloat16), "b": np.zeros(3, np.float32)})
    assert sig(a) != sig({"w": jnp.zeros((2, 3)), "c": np.zeros(3, np.float32)})
    assert sig(jax.ShapeDtypeStruct((3,), jnp.float32)) == sig(np.zeros(3, np.float32))
    assert "Sharding" in sig(jnp.zeros(2))


_ENGINE = """
import json, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
from jaxprm.models import load_model
from jaxprm.serve import Engine
from jaxprm.serve.programs import num_compilations
from jaxprm.serve.sampler import Sampler
from jaxprm.serve.sampling import SamplingParams
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(kw.get("fun_name")) if name.endswith("disk_hits") else None)
model, tok = load_model("tiny")
engine = Engine(Sampler(model, batch_buckets=(1, 4), prompt_buckets=(32,), new_token_buckets=(16,)), max_batch=4).start()
prompts = [tok.encode(t) for t in ("Up", "Down and left and right", "P _ _ O / _ _ G")]
params = [SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_new_tokens=10, temperature=1.0, seed=4),
          SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=5, ignore_eos=True)]
out = engine.submit(prompts, params).result(timeout=300)
engine.stop()
print(json.dumps({"traces": num_compilations(), "hits": hits, "tokens": [c.token_ids for c in out],
                  "logprobs": [list(map(float, c.logprobs)) for c in out]}))
"""


def test_a_second_engine_process_loads_its_programs_without_tracing(tmp_path):
    runs = [subprocess.run([sys.executable, "-c", _ENGINE, str(tmp_path / "xla")], capture_output=True, text=True,
                           cwd=ROOT, timeout=600) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first["traces"] >= 2 and first["hits"] == []
    assert second["traces"] == 0, second  # every program from the store: nothing traced
    assert {"_decode_impl", "_prefill_impl"} <= set(second["hits"])
    assert second["tokens"] == first["tokens"]
    assert second["logprobs"] == first["logprobs"]  # bit for bit


_RESAVE = """
import sys
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jaxprm.serve import executables
x = jnp.arange(2 * 32 * 32, dtype=jnp.float32).reshape(2, 32, 32)
lower = lambda: jax.jit(lambda w: [w[i] * 2.0 for i in range(w.shape[0])]).lower(x)
if sys.argv[2] == "jax":  # fill JAX's own cache only
    jax.jit(lambda w: [w[i] * 2.0 for i in range(w.shape[0])])(x)
else:
    print(sum(float(a.sum()) for a in executables.load_or_compile("slices", (x.shape,), lower)(x)))
"""


def test_a_program_that_jax_has_cached_is_stored_runnable(tmp_path):
    # XLA:CPU serializes an executable loaded from JAX's cache without its code; the store must not
    # keep such a copy (the next process would fail with "Function ... not found")
    outs = []
    for mode in ("jax", "store", "store"):
        r = subprocess.run([sys.executable, "-c", _RESAVE, str(tmp_path / "xla"), mode], capture_output=True,
                           text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(r.stdout.strip())
    assert outs[1] == outs[2] == str(float(2 * sum(range(2 * 32 * 32))))


_ONE_OF_FOUR = r"""
import sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jaxprm.serve import executables
executables.store_dir = lambda: Path(sys.argv[1])
x = jax.device_put(jnp.arange(4.0), jax.devices()[2])  # a one-device program on the third of four devices
lower = lambda: jax.jit(lambda a: a * 2.0 + 1.0).lower(x)
first = executables.load_or_compile("affine", ("x",), lower)
executables._memory.clear()  # what a later process sees: the disk only
loaded = executables.load_or_compile("affine", ("x",), lambda: 1 / 0)
out = loaded(x)
assert out.devices() == {jax.devices()[2]}, out.devices()
np.testing.assert_array_equal(np.asarray(out), np.asarray(first(x)))
print("ok")
"""


def test_a_stored_program_loads_onto_the_devices_it_was_compiled_for(tmp_path):
    """With several devices (8 simulated CPU devices, or one process of a multi-process job), the
    loader must not spread a one-device program over every device of the backend."""
    env = {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", _ONE_OF_FOUR, str(tmp_path / "store")], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
