"""The compilation meter, phase accounting and the persistent compilation cache."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

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
