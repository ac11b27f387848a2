"""Agent rollouts through the recording proxy (``rollout.source: agent``).

The trainer starts the proxy in-process on loopback (``rollout.proxy.ProxyServer``, forwarding to
the same generation server the tree path uses, with the ``prm`` scorers), and per step:

1. starts one group of ``rollout.group_size`` sessions per task and runs the ``agent.workflow``
   agents concurrently (each with its session key, the proxy's base URL and a shared HTTP client);
   the sessions are seeded like the tree path's flat groups of the step (group ``i`` of step ``s``:
   ``f"{seed}:{s * 10000 + i}"``), so requests without a seed of their own sample what the tree
   path would, and a run's rollouts are reproducible;
2. sets each agent's result as its reward and exports the group (in-process: the rows come back
   without serialization; scoring happens in the export). A failed agent discards its group;
   a group rejected by the proxy (a missing session, a scoring failure) is dropped; both counted;
3. records every export's ``prm_stats`` into the step's metrics (outside any retry; successfully
   scored sessions count even when another member rejected the group);
4. applies ``rollout.filter`` and returns ``jaxprm.RowData`` rows (group ids = kept groups) that the
   loop pads into a ``jaxprm.Batch`` and learns from with the same ``compute_advantages`` path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import numpy as np
from httpx_aiohttp import HttpxAiohttpClient

from jaxprm.train.setup import TrainError
from rollout.export import FILTERS
from rollout.proxy import ProxyConfig, ProxyServer
from rollout.proxy.agent_process import AgentProcess
from rollout.proxy.workflow import resolve_workflow, run_agent_group
from scorers import MetricsAccumulator

__all__ = ["AgentRollouts", "AgentStep"]


@dataclasses.dataclass
class AgentStep:
    """One step's agent rollouts: learner rows, the metrics row, the scorers' metrics."""

    rows: list[Any]
    stats: dict[str, Any]
    prm_metrics: Any


class AgentRollouts:
    """Owns the in-process proxy and the agents' HTTP client for a training run."""

    def __init__(self, cfg, tokenizer, upstream, *, max_context_tokens: int | None, log: Callable[[str], None]):
        self.cfg, self.tokenizer, self.upstream, self.log = cfg, tokenizer, upstream, log
        self.max_context_tokens = max_context_tokens
        self.server = None
        self.http = None
        self.processes: list[AgentProcess] = []

    async def start(self) -> None:
        ag = self.cfg.agent
        try:
            self.workflow = resolve_workflow(ag.workflow)
        except (ValueError, TypeError, ImportError) as e:
            raise TrainError(f"agent.workflow={ag.workflow!r}: {e}") from None
        config = ProxyConfig(
            upstream=self.upstream, admin_key=secrets.token_urlsafe(32), chat_template_type=ag.chat_template_type,
            prm=self.cfg.prm.to_dict() if self.cfg.prm.active else None,
            default_max_tokens=self.cfg.rollout.max_new_tokens, max_context_tokens=self.max_context_tokens,
            session_timeout_s=ag.session_timeout_s, drain_timeout_s=ag.timeout_s)
        try:
            self.server = await ProxyServer.start(config, self.tokenizer)
        except Exception as e:
            raise TrainError(f"the recording proxy could not start: {type(e).__name__}: {e}") from e
        n = ag.concurrency
        # An httpx client (what the OpenAI SDK and the agent frameworks take) on aiohttp's connection
        # pool (the SDK's own ``DefaultAioHttpClient``): httpcore's pool checks every connection's
        # socket on every request, which at 64 agents was most of the agent path's rollout time.
        self.http = HttpxAiohttpClient(timeout=httpx.Timeout(ag.timeout_s),
                                       limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))
        self.limiter = asyncio.Semaphore(n)
        for k in range(ag.processes):  # the agents' own interpreters (agent.processes)
            self.processes.append(await self._start_process(k))
        where = f"in {ag.processes} agent process(es)" if ag.processes else "on the trainer's event loop"
        self.log(f"recording proxy on {self.server.url} (agent workflow {ag.workflow}, {where})")

    async def _start_process(self, k: int) -> AgentProcess:
        """Agent process ``k`` (a failed start is a ``TrainError`` naming it)."""
        ag = self.cfg.agent
        try:
            return await AgentProcess.start(ag.workflow, concurrency=ag.concurrency, timeout_s=ag.timeout_s)
        except (ImportError, OSError) as e:
            raise TrainError(f"agent.processes={ag.processes}: agent process {k} could not start: {e}") from None

    async def close(self) -> None:
        processes, self.processes = self.processes, []
        for p in processes:
            await p.close()
        if self.http is not None:
            await self.http.aclose()
            self.http = None
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop()

    async def rollout(self, tasks: Sequence[Any], step: int) -> AgentStep:
        """Run one group per task (see the module docstring)."""
        cfg, ag = self.cfg, self.cfg.agent
        proxy, base_url = self.server.proxy, self.server.base_url
        for k, p in enumerate(self.processes):  # a dead agent process failed its groups; the next step gets a new one
            if not p.alive:
                self.log(f"agent process {k} is gone ({p.process.exitcode=}); starting another")
                await p.close()
                self.processes[k] = await self._start_process(k)
        outcomes = await asyncio.gather(*(  # seeds: those of the tree path's flat group i (group seed step*10000+i)
            run_agent_group(proxy, base_url, task, f"s{step}-g{i}-{getattr(task, 'task_id', i)}",
                            cfg.rollout.group_size, self.processes[i % len(self.processes)] if self.processes
                            else self.workflow, http_client=self.http, timeout_s=ag.timeout_s,
                            kwargs=ag.kwargs, discount=ag.discount, limiter=self.limiter,
                            seed=f"{cfg.seed}:{step * 10_000 + i}")
            for i, task in enumerate(tasks)))
        metrics = MetricsAccumulator()
        stats: dict[str, Any] = {"agent_failed_groups": 0, "prm_rejected_groups": 0, "missing_session_groups": 0}
        ok = []
        for o in outcomes:
            if o.export.prm_stats is not None:
                metrics.merge(o.export.prm_stats.metrics())
            if o.status == "agent_failed":
                stats["agent_failed_groups"] += 1
                self.log(f"agent failed; group {o.group_id} discarded: {o.errors[0]}")
            elif o.status == "rejected":
                key = "prm_rejected_groups" if o.export.rejected["reason"] == "scoring_failed" else "missing_session_groups"
                stats[key] += 1
                self.log(f"group {o.group_id} rejected: {o.export.rejected['message']}")
            elif o.export.rows:
                ok.append(o)
        all_rows = [r for o in ok for r in o.export.rows]
        rewards = [r.outcome_reward for r in all_rows]
        stats.update(
            reward=float(np.mean(rewards)) if rewards else 0.0,
            success=float(np.mean([x for o in ok for x in _successes(o)])) if ok else 0.0,
            groups_with_success=float(np.mean([any(_successes(o)) for o in ok])) if ok else 0.0,
            mixed_groups=float(np.mean([len({r.outcome_reward for r in o.export.rows}) > 1 for o in ok])) if ok else 0.0,
            trajectories=len(all_rows),
            sampled_actions=sum(o.export.records for o in outcomes),
            generated_tokens=sum(o.export.generated_tokens for o in outcomes),
            masked_turns=sum(r.masked_turns for r in all_rows),
            invalid_rate=_invalid_rate(outcomes),
        )
        if cfg.rollout.filter != "none":
            fn = FILTERS[cfg.rollout.filter]
            counters: dict[str, int] = {}
            kept = []
            for o in ok:
                samples = [{"reward": r.outcome_reward, "truncated": r.truncated,
                            "token_rewards": None if r.process_rewards is None else r.process_rewards[r.loss_mask > 0]}
                           for r in o.export.rows]
                if fn(samples, counters=counters):
                    kept.append(o)
            stats.update({f"filter/{k}": v for k, v in counters.items()})
            ok = kept
        stats["kept_groups"] = len(ok)
        rows = [r.to_row_data(gid) for gid, o in enumerate(ok) for r in o.export.rows]
        return AgentStep(rows=rows, stats=stats, prm_metrics=metrics)


def _successes(outcome) -> list[bool]:
    """Each episode of a group: solved? Read from the ``success`` of the last state its workflow
    recorded (``env_states``; the grid games record it) where every episode has one, else an outcome
    reward > 0 (right for FrozenLake's 0/1, wrong for Sokoban's rewards with two boxes, where one
    box on its target is +1 without a solution)."""
    states = []
    for body in outcome.results:
        recorded = list(((body or {}).get("env_states") or {}).values())
        states.append(recorded[-1] if recorded else None)
    if states and all(isinstance(st, dict) and "success" in st for st in states):
        return [bool(st["success"]) for st in states]
    return [r.outcome_reward > 0 for r in outcome.export.rows]


def _invalid_rate(outcomes) -> float:
    """Fraction of turns whose recorded ``env_states`` say ``valid: false`` (0 when none are recorded)."""
    states = [st for o in outcomes for body in o.results if body for st in (body.get("env_states") or {}).values()]
    return sum(1 for st in states if st.get("valid") is False) / max(len(states), 1)
