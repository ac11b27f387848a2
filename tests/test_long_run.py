"""``benchmarks.long_run``'s flatness figures on made-up series: a leak raises the slope and every
block mean; noise around a level leaves the block means at the level."""

from __future__ import annotations

import numpy as np

from benchmarks.long_run import flatness, flatness_table


def _rows(rss):
    return [{"step": s, "rss_mb": float(v), "open_fds": 20, "threads": 30, "compiled_programs": 90}
            for s, v in enumerate(rss, start=1)]


def test_a_leak_raises_the_slope_and_the_block_means():
    f = flatness(_rows(1000 + 0.5 * np.arange(300)), warmup=50)["rss_mb"]
    assert f["slope_per_100_steps"] == 50.0
    assert np.all(np.diff(f["block_means"]) == 25.0) and len(f["block_means"]) == 5  # steps 50..299


def test_noise_leaves_the_block_means_level():
    rng = np.random.default_rng(0)
    f = flatness(_rows(2000 + rng.normal(0, 100, 500)), warmup=50)
    assert max(abs(b - 2000) for b in f["rss_mb"]["block_means"]) < 50
    assert f["open_fds"]["slope_per_100_steps"] == 0 and f["open_fds"]["block_means"] == [20.0] * 9
    table = flatness_table({"flatness": f})
    assert "| open_fds | 20 | 20 | 20 | 20 | 0 | 20 / 20 / 20 |" in table.splitlines()
