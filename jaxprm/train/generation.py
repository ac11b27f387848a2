"""The trainer's generation side: the server(s) rollouts talk to and the weights they serve.

``server.kind: embedded`` starts ``jaxprm.serve`` in-process on a free loopback port and swaps new
weights in place (a new weight version per step); ``external`` talks to running vLLM / SGLang /
jaxprm servers at ``server.urls`` and syncs weights by saving the policy in Hugging Face format and
calling ``/update_weights_from_disk`` on each (through the rollout client's retry policy).

An external server that dies is marked down by the client and its requests go to the others (the
same request, so the same per-request seed). When it answers its health probe again (a restarted
vLLM serves its *base* weights), :meth:`Generation._restore` pushes the weights last synced and
checks ``/get_weight_version`` before the server gets requests again; if every server stays down
past ``server.unavailable_timeout_s`` the run stops with one line (``--resume`` continues). The
embedded server is the same case with one server: found dead by a lost connection (or, between
steps, by :meth:`sync`), it is restarted in place on its port with the weights it served
(:meth:`Generation._revive`), and must report the synced weight version before it gets work. Each
train row counts the step's failovers (``server_failovers``, ``server_downs``,
``server_recoveries``, ``servers_down``).

The embedded server requires a random API key that only the trainer's client is given, and loads
weights from disk only under the run directory, so another local process cannot steer it.
:meth:`Generation.check_behavior` watches the symptom anyway: a train row's ``behavior_kl`` above
``server.warn_behavior_kl`` is a warning, above ``server.max_behavior_kl`` a :class:`TrainError`.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxprm.models import save_pretrained
from jaxprm.serve import ServerHandle
from jaxprm.serve.sampling import buckets_up_to
from jaxprm.train import multihost
from jaxprm.train.adapters import prompt_builder
from jaxprm.train.config import TrainConfig
from jaxprm.train.policy import Policy
from jaxprm.train.setup import TrainError
from rollout.client import GenerationClient, GenerationError

__all__ = ["Generation"]


def _copy(params: Any, *, copy: bool = True) -> Any:
    """The weights to serve: a copy (``copy``: the train step donates its own; else the arrays
    themselves), or, where the learner's arrays span several processes, this host's whole copy of
    them (a collective)."""
    if all(x.is_fully_addressable for x in jax.tree.leaves(params) if isinstance(x, jax.Array)):
        return jax.tree.map(jnp.copy, params) if copy else params
    return multihost.host_copy(params)


class Generation:
    """Owns the generation client (and the embedded server, if any). ``client``, ``prompts`` and
    ``max_context`` are what rollouts need."""

    def __init__(self, cfg: TrainConfig, policy: Policy, run_dir: Path, log) -> None:
        self.cfg, self.policy, self.run_dir, self.log = cfg, policy, run_dir, log
        self.server: ServerHandle | None = None
        self.client: GenerationClient | None = None
        self.prompts = prompt_builder(cfg, policy.tokenizer)  # env.action_format's tools and prefill
        self.max_context = policy.config.max_position_embeddings
        self.version = 0  # the weight version the server(s) have: the learner step that made the weights
        self._pushed: tuple[int, Path] | None = None  # external: the last weights saved for the servers
        self._counted: dict[str, int] = {}  # the client's counters at the last row

    async def start(self, *, resume_step: int = 0, push_weights: bool = False) -> None:
        """Start the embedded server or check the external ones. An external server gets the
        learner's weights first when it cannot have them: on resume (the restored step's) and with
        ``push_weights`` (a warm-started policy, version 0)."""
        s = self.cfg.server
        api_key = s.api_key
        if s.kind == "embedded":
            api_key = secrets.token_urlsafe(32)  # known to this process only: nobody else can steer the server
            self.server = ServerHandle.start(
                self.policy.module(_copy(self.policy.params)), self.policy.tokenizer, host="127.0.0.1", port=0,
                config=s.serve_config(api_key=api_key, weights_roots=(str(self.run_dir),)),
                sampler_kwargs={"max_batch": s.max_batch, "max_context": self.max_context,
                                "batch_buckets": buckets_up_to(s.batch_buckets, s.max_batch),
                                "weight_version": resume_step})  # restored weights: the resumed step's
            urls = [self.server.url]
            self.log(f"embedded server on {self.server.url} (API key required)")
        else:
            urls = list(s.urls)
        self.client = GenerationClient(s.client_config(urls, api_key=api_key))
        self.client.on_recover = self._restore  # embedded too: nothing to push, the version is checked
        if s.kind == "embedded":
            self.client.before_probe = self._revive
        if s.kind == "external":
            await self.client.check_health()
            if s.token_backed:
                await self.client.probe_token_io(self.prompts.initial([{"role": "user", "content": "Hi"}]))
            if resume_step > 0 or push_weights:
                await self.sync(resume_step)
        self.version = resume_step

    async def sync(self, step: int) -> None:
        """Serve the policy's current params as weight version ``step``.

        In a distributed run every process calls it: each swaps the weights of its own embedded
        server; external servers are updated once, by process 0, and the others wait for it."""
        if self.server is not None:
            if not self.server.alive:  # died since the last step without a request noticing
                await self._revive(self.server.url)
            self.server.update_weights(self.policy.serving_params(_copy(self.policy.params)), version=step)
            self.version = step
            return
        params = _copy(self.policy.params, copy=False)  # saved to disk, not kept
        if multihost.is_primary():
            s = self.cfg.server
            out = Path(s.weight_sync_dir or (self.run_dir / "weights")).absolute() / f"step-{step}"
            save_pretrained(self.policy.module(params), self.policy.tokenizer, out)
            self._pushed = (step, out)  # what a server that recovers from now on gets
            await self.client.update_weights_from_disk(str(out), weight_version=step)  # the servers up
            prev = out.parent / f"step-{step - 1}"
            if prev.exists():
                shutil.rmtree(prev, ignore_errors=True)
            await self.client.recover()  # a server back since the last step gets these weights now
        multihost.barrier(f"jaxprm-weight-sync-{step}")
        self.version = step

    async def _restore(self, endpoint: str) -> None:
        """The client's ``on_recover`` hook: a server that answers again gets the weights last synced
        (none synced to disk -- version 0, or the embedded server, whose restart keeps its sampler's
        weights -- nothing is pushed), then must report that weight version; a
        sync that lands meanwhile is pushed too. Raises :class:`GenerationError` (it stays down)."""
        while True:
            version, path = self._pushed or (self.version, None)
            if path is not None:
                await self.client.update_weights_from_disk(str(path), weight_version=version, endpoints=[endpoint])
            served = await self.client.weight_version(endpoint)
            if served != version:
                raise GenerationError(f"{endpoint} serves weight version {served} after recovery, not {version}")
            if (self._pushed or (self.version, None))[0] == version:
                break
        self.log(f"generation server {endpoint} is back, serving weight version {version}")

    async def _revive(self, endpoint: str) -> None:
        """The client's ``before_probe`` hook for the embedded server: one found dead (its HTTP
        thread or its engine stopped) is served again in place -- the same port, the same sampler,
        so the weights last synced and their version -- and the probe then checks it (:meth:`_restore`)."""
        if self.server is None or self.server.alive:
            return
        self.log(f"the embedded server on {endpoint} died; restarting it in place")
        self.server = await asyncio.to_thread(self.server.restarted)

    def server_health(self) -> dict[str, int]:
        """Failover counts since the last call (the step's): ``server_failovers`` (requests sent again
        to another server after a lost connection), ``server_downs``, ``server_recoveries``; and
        ``servers_down`` (now)."""
        stats = self.client.stats() if self.client is not None else {}
        names = {"failovers": "server_failovers", "marked_down": "server_downs", "recovered": "server_recoveries"}
        out = {row: stats.get(key, 0) - self._counted.get(key, 0) for key, row in names.items()}
        self._counted = stats
        out["servers_down"] = stats.get("down", 0)
        return out

    def check_behavior(self, step: int, row: dict[str, Any]) -> None:
        """Warn (``server.warn_behavior_kl``) or stop with :class:`TrainError`
        (``server.max_behavior_kl``) when the train row's ``behavior_kl`` shows that the rollouts
        were not sampled from the learner's policy. Rows without it (no update) pass."""
        kl = row.get("behavior_kl")
        if kl is None:
            return
        s = self.cfg.server
        kl = float(kl)
        where = "the embedded server" if self.server is not None else "the external server(s)"
        if s.max_behavior_kl is not None and not kl <= s.max_behavior_kl:  # NaN stops too
            raise TrainError(
                f"step {step}: behavior_kl={kl:.4g} exceeds server.max_behavior_kl={s.max_behavior_kl}: {where} did not "
                "sample from the learner's policy (weights replaced by someone else, or a weight sync that did not "
                "take), so the step's data is off-policy; stopping. The last checkpoint is kept: fix the server and "
                "--resume, or raise server.max_behavior_kl (null: never stop)")
        if not kl <= s.warn_behavior_kl:
            self.log(f"WARNING: step {step}: behavior_kl={kl:.4g} > server.warn_behavior_kl={s.warn_behavior_kl}: "
                     f"{where} is not sampling from the learner's policy (weights replaced by someone else? a weight "
                     "sync that did not take? sampling at temperature or top_p != 1?)")

    async def aclose(self) -> None:
        """Close the client, then stop the embedded server (both even if the first fails)."""
        try:
            if self.client is not None:
                await self.client.aclose()
        finally:
            if self.server is not None:
                self.server.stop()
