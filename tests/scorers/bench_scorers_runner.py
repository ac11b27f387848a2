"""Host-side cost of PRMRunner (not a test): python tests/scorers/bench_scorers_runner.py

Measures run() on one branch of T turns whose conversation grows like a concat chat (two ~400-char
messages per turn), with three cheap scorers, and score_branches on a PaTR-like tree. The cost is
the runner's own work (private copies, validation, commits), since the scorers do almost nothing.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from prm_test_scorers import ConstScorer, DenseScorer, response  # noqa: E402
from rollout.types import Interaction, InteractionTree  # noqa: E402
from scorers import LengthBudgetScorer, PRMConfig, PRMRunner  # noqa: E402

TEXT = "x" * 400


def branch(turns: int, prefix: str = "b", parent: Interaction | None = None, msgs=None) -> list[Interaction]:
    msgs = list(msgs or [{"role": "system", "content": TEXT}, {"role": "user", "content": TEXT}])
    out = []
    for i in range(turns):
        it = Interaction(f"{prefix}{i}", (out[-1].id if out else (parent.id if parent else None)), list(msgs),
                         [{"role": "assistant", "content": TEXT}], model_response=response(64))
        out.append(it)
        msgs = [*msgs, {"role": "assistant", "content": TEXT}, {"role": "tool", "content": TEXT}]
    return out


async def timed(make_coro, repeat: int = 5) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await make_coro()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


async def main() -> None:
    runner = PRMRunner(PRMConfig(), scorers=[ConstScorer(), DenseScorer(), LengthBudgetScorer(max_output_tokens=128)])
    for turns in (10, 50, 100):
        b = branch(turns)
        t = await timed(lambda: runner.run(b))
        print(f"run(): {turns:4d} turns x 3 scorers: {t * 1e3:8.1f} ms  ({t / turns / 3 * 1e6:6.0f} us per scorer call)")
    # PaTR-like tree: 4 roots of 5 turns, each expanded into 2 children of 5 more turns -> 8 leaves x 10 turns
    tree = InteractionTree()
    for r in range(4):
        trunk = branch(5, f"r{r}_")
        for it in trunk:
            tree.add(it)
        for c in range(2):
            for it in branch(5, f"r{r}c{c}_", parent=trunk[-1], msgs=trunk[-1].messages):
                tree.add(it)
    t = await timed(lambda: runner.score_branches(tree))
    print(f"score_branches(): 8 leaves x 10 turns x 3 scorers: {t * 1e3:.1f} ms")


if __name__ == "__main__":
    asyncio.run(main())
