"""Runner construction from config, ownership, startup rollback and cleanup semantics."""

from __future__ import annotations

import asyncio
import logging

import pytest

import prm_test_scorers as pts
from prm_test_scorers import ConstScorer, ResourceScorer, chain, run
from scorers import LengthBudgetScorer, PRMConfig, PRMRunner


@pytest.fixture(autouse=True)
def _reset():
    ResourceScorer.instances.clear()
    ResourceScorer.close_order.clear()
    yield
    ResourceScorer.instances.clear()
    ResourceScorer.close_order.clear()


def spec(cls: str, label: str, **kw):
    enabled = kw.pop("enabled", True)
    return {"path": f"prm_test_scorers.{cls}", "enabled": enabled, "kwargs": {"label": label, **kw}}


# -- building from config ---------------------------------------------------------------------------


def test_dotted_paths_are_resolved_and_weights_applied():
    cfg = {"scorers": [{"path": "scorers.LengthBudgetScorer", "weight": 0.5, "kwargs": {"max_output_tokens": 2}}]}
    r = PRMRunner(cfg)
    (s,) = r.scorers
    assert isinstance(s, LengthBudgetScorer) and s.weight == 0.5 and r.owns(s)
    res = run(r.run(chain([2, 3])))
    assert list(res["t0"]) == [0.5, 0.5] and list(res["t1"]) == [0.0, 0.0, 0.0]
    # module:Class spelling too
    r2 = PRMRunner({"scorers": [{"path": "scorers.length_budget:LengthBudgetScorer", "kwargs": {"max_output_tokens": 2}}]})
    assert isinstance(r2.scorers[0], LengthBudgetScorer)


@pytest.mark.parametrize(
    ("path", "exc", "match"),
    [
        ("no_such_module_xyz.Scorer", ImportError, "no_such_module_xyz"),
        ("prm_test_scorers.Missing", ImportError, "has no attribute 'Missing'"),
        ("prm_test_scorers.NotAScorer", TypeError, "not a BaseScorer subclass"),
        ("Scorer", ValueError, "package.module.Class"),
    ],
)
def test_bad_paths_fail_with_the_key(path, exc, match):
    with pytest.raises(exc, match=match) as info:
        PRMRunner({"scorers": [{"path": path}]})
    assert "prm.scorers[0].path" in str(info.value)  # the message itself: the CLI prints only str(e)


def test_constructor_errors_name_the_entry():
    with pytest.raises(ValueError, match="max_output_tokens") as info:
        PRMRunner({"scorers": [{"path": "scorers.LengthBudgetScorer", "kwargs": {"max_output_tokens": 0}}]})
    assert any("prm.scorers[0]" in n for n in info.value.__notes__)
    with pytest.raises(TypeError, match="unknown keyword"):
        PRMRunner({"scorers": [{"path": "scorers.LengthBudgetScorer", "kwargs": {"max_output_tokens": 4, "bogus": 1}}]})


def test_names_must_be_unique_within_a_runner():
    with pytest.raises(ValueError, match="'const' is already used"):
        PRMRunner(PRMConfig(), scorers=[ConstScorer(), ConstScorer()])


def test_config_or_instances_not_both_and_disabled_config_builds_nothing():
    with pytest.raises(ValueError, match="not both"):
        PRMRunner({"scorers": [spec("ResourceA", "a")]}, scorers=[ConstScorer()])
    r = PRMRunner({"enabled": False, "scorers": [spec("ResourceA", "a")]})
    assert r.scorers == () and not r.active and ResourceScorer.instances == []


def test_disabled_entries_are_built_owned_and_skipped():
    r = PRMRunner({"scorers": [spec("ResourceA", "a", enabled=False)]})
    assert len(r.scorers) == 1 and not r.active
    run(r.aclose())
    assert ResourceScorer.close_order == ["a"]


# -- closing --------------------------------------------------------------------------------------------


def test_owned_close_in_reverse_order_once_and_borrowed_never():
    borrowed = pts.ResourceD(label="borrowed")
    cfg = {"scorers": [spec("ResourceA", "first"), spec("ResourceB", "second"), spec("ResourceC", "disabled", enabled=False)]}
    r = PRMRunner(cfg)
    r_borrow = PRMRunner(PRMConfig(), scorers=[borrowed])

    async def go():
        await r.aclose()
        await r.aclose()  # later close: no retry, no second hook call
        await r_borrow.aclose()

    run(go())
    assert ResourceScorer.close_order == ["disabled", "second", "first"]
    assert all(s.close_calls == 1 and s.flushed for s in r.scorers)
    assert borrowed.close_calls == 0
    assert not r_borrow.owns(borrowed)
    # the borrowed instance stays usable by its owner
    assert run(borrowed.evaluate(None, {})) == 1.0


def test_run_is_refused_once_closing_started():
    r = PRMRunner({"scorers": [spec("ResourceA", "a")]})
    run(r.aclose())
    with pytest.raises(RuntimeError, match="closed"):
        run(r.run(chain([1])))
    with pytest.raises(RuntimeError, match="closed"):
        run(r.score_branches(pts.tree_of(chain([1]))))


def test_cleanup_failures_are_grouped_after_every_owned_scorer_was_attempted(caplog):
    cfg = {"scorers": [spec("ResourceA", "good"), spec("ResourceB", "bad-1", fail_close=True), spec("ResourceC", "bad-2", fail_close=True)]}
    r = PRMRunner(cfg)
    with caplog.at_level(logging.ERROR, logger="scorers.runner"):
        with pytest.raises(ExceptionGroup, match="PRM scorer cleanup failed for 2") as info:
            run(r.aclose())
    assert ResourceScorer.close_order == ["bad-2", "bad-1", "good"]
    assert [str(e) for e in info.value.exceptions] == ["cannot flush bad-2", "cannot flush bad-1"]
    assert r.scorers[0].flushed
    assert sum("closing scorer" in rec.getMessage() for rec in caplog.records) == 2
    run(r.aclose())  # does not retry the failed hooks
    assert all(s.close_calls == 1 for s in r.scorers)


def test_concurrent_closes_wait_for_one_cleanup():
    r = PRMRunner({"scorers": [spec("ResourceA", "a")]})
    (s,) = r.scorers

    async def go():
        s.release = asyncio.Event()
        s.close_started = asyncio.Event()
        first = asyncio.create_task(r.aclose())
        second = asyncio.create_task(r.aclose())
        await asyncio.wait_for(s.close_started.wait(), 2)
        await asyncio.sleep(0.01)
        assert not first.done() and not second.done()  # the second waits for the first's cleanup
        with pytest.raises(RuntimeError, match="closed"):
            await r.run(chain([1]))
        s.release.set()
        await asyncio.gather(first, second)

    run(go())
    assert s.close_calls == 1 and s.flushed


def test_cancelling_close_propagates_and_is_not_retried():
    cfg = {"scorers": [spec("ResourceA", "a"), spec("ResourceB", "b")]}
    r = PRMRunner(cfg)
    a, b = r.scorers

    async def go():
        b.release = asyncio.Event()
        b.close_started = asyncio.Event()
        pending = asyncio.create_task(r.aclose())
        waiter = asyncio.create_task(r.aclose())
        await asyncio.wait_for(b.close_started.wait(), 2)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await asyncio.wait_for(waiter, 2)  # a concurrent waiter is released, not cancelled
        await r.aclose()  # later close: no retry

    run(go())
    assert not b.flushed and b.close_calls == 1
    assert a.close_calls == 0  # interrupted before reaching it; never retried


def test_async_context_manager_closes():
    async def go():
        async with PRMRunner({"scorers": [spec("ResourceA", "a")]}) as r:
            await r.run(chain([1]))
        return r

    r = run(go())
    assert r.closing and r.scorers[0].flushed


# -- async startup rollback -------------------------------------------------------------------------------


def test_create_builds_like_the_constructor():
    async def go():
        r = await PRMRunner.create({"scorers": [spec("ResourceA", "a")]})
        res = await r.run(chain([2]))
        await r.aclose()
        return res

    assert list(run(go())["t0"]) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("bad", "exc", "match"),
    [
        ({"path": "prm_test_scorers.ResourceC", "kwargs": {"label": "c", "fail_init": True}}, RuntimeError, "cannot start c"),
        ({"path": "no_such_module_xyz.S"}, ImportError, "no_such_module_xyz"),
        ({"path": "prm_test_scorers.ResourceA", "kwargs": {"label": "dup"}}, ValueError, "already used"),
    ],
)
def test_create_rolls_back_built_scorers_in_reverse_then_reraises(bad, exc, match):
    cfg = {"scorers": [spec("ResourceA", "a"), spec("ResourceB", "b"), bad]}
    with pytest.raises(exc, match=match):
        run(PRMRunner.create(cfg))
    expected = ["dup", "b", "a"] if bad.get("kwargs", {}).get("label") == "dup" else ["b", "a"]
    assert ResourceScorer.close_order == expected
    assert all(s.close_calls == 1 for s in ResourceScorer.instances)


def test_sync_constructor_has_no_rollback():
    cfg = {"scorers": [spec("ResourceA", "a"), {"path": "no_such_module_xyz.S"}]}
    with pytest.raises(ImportError):
        PRMRunner(cfg)
    assert ResourceScorer.close_order == [] and len(ResourceScorer.instances) == 1


def test_rollback_cleanup_failures_become_notes_and_keep_the_original_error(caplog):
    cfg = {"scorers": [spec("ResourceA", "a", fail_close=True), spec("ResourceB", "b"), {"path": "no_such_module_xyz.S"}]}
    with caplog.at_level(logging.ERROR, logger="scorers.runner"):
        with pytest.raises(ImportError) as info:
            run(PRMRunner.create(cfg))
    assert ResourceScorer.close_order == ["b", "a"]
    assert any("cleanup of scorer 'res_a'" in n and "cannot flush a" in n for n in info.value.__notes__)
    assert any("startup failure" in rec.getMessage() for rec in caplog.records)


def test_create_never_closes_borrowed_scorers():
    borrowed = pts.ResourceA(label="mine")
    with pytest.raises(ValueError, match="already used"):
        run(PRMRunner.create(PRMConfig(), scorers=[borrowed, pts.ResourceA(label="twin")]))
    assert ResourceScorer.close_order == []


def test_cancellation_during_rollback_propagates(monkeypatch):
    cfg = {"scorers": [spec("ResourceA", "a"), spec("ResourceB", "b"), {"path": "no_such_module_xyz.S"}]}

    async def go():
        started = asyncio.Event()

        async def blocking(self):
            started.set()
            await asyncio.Event().wait()

        monkeypatch.setattr(pts.ResourceB, "aclose", blocking)
        task = asyncio.create_task(PRMRunner.create(cfg))
        await asyncio.wait_for(started.wait(), 2)  # rollback reached b (built last, closed first)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(go())
    a = next(s for s in ResourceScorer.instances if s.label == "a")
    assert a.close_calls == 0  # cancellation stopped the rollback; nothing swallowed it


def test_create_with_a_bad_config_builds_nothing():
    with pytest.raises(ValueError, match="unknown keys"):
        run(PRMRunner.create({"scorer": []}))
    assert ResourceScorer.instances == []


def test_none_config_means_disabled_unless_instances_are_given():
    assert not PRMRunner(None).active
    r = PRMRunner(None, scorers=[ConstScorer(2.0)])
    assert r.active and list(run(r.run(chain([2])))["t0"]) == [2.0, 2.0]
