"""The compilation meter, phase accounting and the persistent compilation cache."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from jaxprm.train.compilation import METER, PhaseTimes

ROOT = Path(__file__).resolve().parents[2]


def test_the_meter_counts_compilations_in_any_thread():
    import threading

    before = METER.snapshot()
    jax.jit(lambda x: x * 3 + 1)(jnp.ones(7))
    t = threading.Thread(target=lambda: jax.jit(lambda x: x - 5)(jnp.ones(9)))
    t.start()
    t.join()
    d = METER.snapshot() - before
    assert d.count >= 2 and d.seconds > 0


def test_phases_nest_and_compilation_is_its_own_phase():
    times = PhaseTimes()
    with times.phase("setup") as outer:
        time.sleep(0.05)
        with times.phase("warm_start") as inner:
            jax.jit(lambda x: jnp.cos(x) * 11)(jnp.ones(13))
            time.sleep(0.05)
    s = times.seconds
    assert inner.compile > 0 and outer.compile >= inner.compile
    assert abs(sum(s.values()) - outer.wall) < 1e-6  # every second counted once
    assert s["compile"] == inner.compile and s["warm_start"] >= 0.05 and s["setup"] >= 0.05
    assert times.programs >= 1


def test_the_phases_account_for_the_whole_wall_time_and_none_is_negative():
    times = PhaseTimes()
    t0 = time.perf_counter()
    time.sleep(0.02)  # measured by no phase: lands in "other"
    with times.phase("learn"):
        jax.jit(lambda x: jnp.sin(x) * 7)(jnp.ones(17))
    with times.phase("export"):
        pass
    wall = time.perf_counter() - t0
    timings = times.account(wall)
    assert list(timings) == list(PhaseTimes.ORDER)
    assert all(v >= 0 for v in timings.values())
    assert abs(sum(timings.values()) - wall) < 1e-9
    assert timings["other"] >= 0.02
    assert times.account(0.0)["other"] == 0.0  # phases that overran the wall never make "other" negative


_PROGRAM = """
import jax, jax.numpy as jnp
from jaxprm.train.compilation import METER, enable_persistent_cache
enable_persistent_cache({d!r})
before = METER.snapshot()
jax.jit(lambda x: jnp.tanh(x) @ x.T + 17.0)(jnp.ones((64, 64)))
d = METER.snapshot() - before
print(d.count, d.cache_hits)
"""


def test_a_second_process_loads_its_programs_from_the_persistent_cache(tmp_path):
    runs = [subprocess.run([sys.executable, "-c", _PROGRAM.format(d=str(tmp_path / "xla"))], capture_output=True,
                           text=True, cwd=ROOT, timeout=120) for _ in range(2)]
    first, second = ([int(x) for x in r.stdout.split()] for r in runs)
    assert first[1] == 0 and second[1] >= 1 and second[1] == second[0], (first, second)


def test_the_background_compiler_compiles_once_per_key_apart_from_the_phases():
    from jaxprm.train.compilation import BackgroundCompiler

    f = jax.jit(lambda x: jnp.sin(x) * 23.0 + x)
    bc = BackgroundCompiler()
    before, bg0 = METER.snapshot(), METER.background()
    assert bc.submit("a", lambda: f.lower(jax.ShapeDtypeStruct((31,), jnp.float32)))
    assert not bc.submit("a", lambda: f.lower(jax.ShapeDtypeStruct((31,), jnp.float32)))  # once per key
    bc.mark("b")
    assert not bc.submit("b", lambda: f.lower(jax.ShapeDtypeStruct((32,), jnp.float32)))
    assert bc.submit("bad", lambda: 1 / 0)
    assert bc.wait(timeout=120)
    bc.close()
    assert bc.compiled == 1 and len(bc.errors) == 1 and "ZeroDivisionError" in bc.errors[0]
    assert (METER.background() - bg0).count == 1 and (METER.snapshot() - before).count == 0
    assert not bc.submit("c", lambda: f.lower(jax.ShapeDtypeStruct((33,), jnp.float32)))  # closed


_PRECOMPILE = """
import sys
import jax, optax
import jaxprm
from jaxprm.train.compilation import METER, BackgroundCompiler, enable_persistent_cache
from jaxprm.train.packed import PackedTrainStep, packed_row_buckets, packed_step_inputs, precompile_neighbours
from jaxprm.train.policy import Policy
from tests.learner.trees import random_groups
from tests.train._models import toy_transformer
enable_persistent_cache(sys.argv[1])
policy = Policy(toy_transformer())
step = PackedTrainStep(policy.apply_fn, optax.adamw(1e-3), epochs=1, num_minibatches=2,
                       loss_kwargs={"eps_clip": 0.2, "agg": "token-mean"})
state = step.init_state(policy.params)

def inputs(groups, T):
    rows = random_groups(0, groups=groups, leaves=(2, 4), share=0.8, vocab=64, turns=3)
    flat = jaxprm.pad_rows(rows, row_buckets=(32,), len_buckets=(T,), min_rows=32)
    packed = jaxprm.pack_rows(rows, flat_shape=flat.shape, row_buckets=packed_row_buckets(2), len_buckets=(128,),
                              trees_per_row=1)
    adv = jaxprm.compute_advantages(flat, jaxprm.AdvantageConfig(group_reward_norm=True)).advantages
    return packed_step_inputs(packed, flat, adv, agg="token-mean")

first, second = inputs(2, 64), inputs(3, 64)  # 2 / 3 trees, one a row: R = 2 / 4, S = T = 64
assert first["key_blocks"].shape == (2, 4, 64) and second["key_blocks"].shape == (4, 4, 64)
if sys.argv[2] == "precompile":
    state, _ = step(state, first, jax.random.key(0))
    bc = BackgroundCompiler()
    n = precompile_neighbours(bc, step, state, first, jax.random.key(0), packed_row_buckets(2), (32, 64, 96))
    assert bc.wait(timeout=300) and not bc.errors, bc.errors
    bc.close()
    print(n, bc.compiled, end=" ")
before = METER.snapshot()
state, _ = step(state, second, jax.random.key(1))
d = METER.snapshot() - before
print(d.count, d.cache_hits, step.compiles)
"""


@pytest.mark.slow  # two fresh processes compiling learner steps: 48 s of the default suite on 2 cores
def test_neighbouring_learner_shapes_compiled_in_the_background_are_loaded_later(tmp_path):
    from jaxprm.train.packed import neighbour_shapes

    got = neighbour_shapes({"R": 8, "S": 640}, {"S": (512, 640, 768), "R": (4, 8, 16)})
    assert got == [{"R": 8, "S": 512}, {"R": 8, "S": 768}, {"R": 4, "S": 640}, {"R": 16, "S": 640}]
    assert neighbour_shapes({"R": 4, "S": 512}, {"S": (512, 640), "R": (4, 8)}) == [{"R": 4, "S": 640}, {"R": 8, "S": 512}]
    assert neighbour_shapes({"R": 5, "S": 512}, {"R": (4, 8), "S": (512,)}) == []
    runs = [subprocess.run([sys.executable, "-c", _PRECOMPILE, str(tmp_path / "xla"), mode], capture_output=True,
                           text=True, cwd=ROOT, timeout=600) for mode in ("precompile", "load")]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    n, compiled, count, hits, compiles = (int(x) for x in runs[0].stdout.split())
    # (S, N, R): S 32 and 96, N 8 (4 is the smallest block bucket), R 4 (2 is the smallest row bucket)
    assert n == compiled == 4
    # in the same process the step with R = 4 reuses the background's trace and program
    assert count == 0 and compiles == 1, (count, compiles)
    # a later process loads it from the persistent cache: the keys match the real call's
    count, hits, compiles = (int(x) for x in runs[1].stdout.split())
    assert count >= 1 and hits == count and compiles == 1, (count, hits)
