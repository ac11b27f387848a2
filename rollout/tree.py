"""Group rollouts: flat GRPO / DAPO, Tree-Random, PaTR and ARPO over one machinery (layer 4).

A *group* is every trajectory sampled for one task. All strategies share the same loop:

    A <- B0 fresh branches (flat, dapo: G);  C <- {}
    while A is not empty (or, with refill, free slots remain):
        advance every branch of A concurrently for up to K turns   (flat, dapo: until it ends; arpo: 1)
        move branches that ended (env done, max_turns, context full, theta-loop) to C
        if A is not empty (tree strategies only):
            tree_random / patr (a checkpoint):
                (theta_at="checkpoint": branches of A whose last theta actions are identical -> C, "loop")
                s_i = score(branch_i) in [0, 1]          (patr: branch scorer; tree_random: uniform)
                E = the top_k branches by score that fit under max_branches
                L = branches of A \\ E with s_i < median(s over A) - alpha    (pruned)
                A <- (A \\ (E u L)) u {M children of each e in E};  C <- C u L
            arpo (entropy-adaptive branching, after every turn = tool-call boundary):
                for each branch b of A in order, while free slots remain:
                    u ~ U(0, 1);  p = clip(u - w * (H_now(b) - H_init(b)), 0, 1)
                    if p <= branch_probability: add min(beam_size - 1, free) children of b to A
        if A is empty, refill and max_branches - |C| > 0:
            tree_random / patr: branch again from the best-scored checkpoint states seen so far
                (from the root if none), one slot at a time (up to B0 at once)
            arpo: restart one branch from the root (ARPO restarts a finished sample from its prompt)

``max_branches`` (default ``group_size``) is a hard cap on live + finished branches, so with refill a
tree group has exactly that many trajectories, the same budget as a flat group of that size (dead slots left by
branches that fell into holes early are refilled rather than lost). ``"dapo"`` rolls out exactly
like ``"flat"`` (DAPO's dynamic sampling and overlong shaping live in the trainer).

Theta rule: with ``theta_at="turn"`` (default) a branch whose last ``theta`` actions are identical
is stopped right after that turn, for every strategy (so that a loop does not burn the rest of an
interval); with ``theta_at="checkpoint"`` (the PaTR paper) the rule is checked only among the
active branches at a tree checkpoint, just before scoring, so flat / dapo / arpo groups never
loop-stop. Pruned and loop-stopped branches stay in the group as negatives under
``keep="keep_all"`` and are dropped under ``"best_n"``.

ARPO's entropy of a turn is the mean of the per-token entropies of its response's first
``arpo.entropy_tokens`` tokens (:attr:`rollout.client.Generated.entropies`, the top
``arpo.top_logprobs`` distribution renormalised; arpo requests ask for them); ``H_init`` is the
entropy of the first turn of a branch's lineage (children inherit it). The ``u`` draws come from a
generator seeded by (config seed, group seed, round index).

Children copy the parent's token prefix, messages and env state (``env.clone()``); all requests of a
group use one sticky route key, so a server with prefix caching sees siblings' shared prefixes.
Per-request seeds are derived from (config seed, group seed, branch id, turn), so a group is
reproducible against a deterministic server. Give every group of a training run its own
``group_seed`` (e.g. ``step * groups_per_step + i``): it also names the group's interactions.

Entry points: ``run_group`` / ``run_groups`` return :class:`GroupResult` (tree, the group's leaves,
:class:`GroupStats`); ``rollout.export.export_groups`` turns a list of them into a ``jaxprm.Batch``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from jaxprm.fields import require
from rollout.chat import ChatTokenizer, PromptBuilder, check_extends
from rollout.client import MAX_TOP_LOGPROBS, Generated, GenerationClient, SamplingParams
from rollout.envs.base import Env
from rollout.types import Interaction, InteractionTree, branch_messages
from scorers import BaseScorer, ScoringRejected, score_branch

__all__ = [
    "request_seed",
    "TreeConfig",
    "TreeParams",
    "LeafRecord",
    "CheckpointStats",
    "GroupStats",
    "GroupResult",
    "ProcessRewards",
    "RolloutError",
    "GroupRejected",
    "run_group",
    "run_groups",
    "STRATEGIES",
    "FLAT_STRATEGIES",
    "ARPOParams",
    "GROUP_MODES",
    "THETA_AT",
]

STRATEGIES = ("flat", "tree_random", "patr", "arpo", "dapo")
FLAT_STRATEGIES = ("flat", "dapo")  # independent samples, no tree
SCORED_STRATEGIES = ("tree_random", "patr")  # trees with checkpoints
GROUP_MODES = ("keep_all", "best_n")
THETA_AT = ("turn", "checkpoint")
DROPPED_UNDER_BEST_N = ("pruned", "loop")
#: A group's process rewards: ``{leaf_id: {interaction_id: float32[output_len]}}``.
ProcessRewards = Mapping[str, Mapping[str, np.ndarray]]


class RolloutError(RuntimeError):
    """A group could not be rolled out (a request, env step or scorer failed); the cause is chained."""


class GroupRejected(RolloutError):
    """PaTR's branch scorer could not score a checkpoint of this group (it raised, returned an
    invalid score or one outside [0, 1], or timed out): the group is rejected, not the rollout.
    ``group_key`` names the group and ``kind`` says why (as ``scorers.ScoringRejected.kind``)."""

    def __init__(self, message: str, *, group_key: str, kind: str) -> None:
        super().__init__(message)
        self.group_key = group_key
        self.kind = kind

    @property
    def causes(self) -> list[str]:
        """The type names down the ``__cause__`` chain, outermost first (e.g. ``["ScoringRejected",
        "ScorerHTTPError"]``): what the trainer's ``branch_rejected`` counts and log lines name."""
        if self.__cause__ is None:  # unpickled on another process: the names travelled, not the chain
            return list(self.__dict__.get("_cause_names", []))
        names, err, seen = [], self.__cause__, set()
        while err is not None and id(err) not in seen:
            seen.add(id(err))
            names.append(type(err).__name__)
            err = err.__cause__
        return names

    def __reduce__(self):
        return _unpickle_group_rejected, (str(self), self.group_key, self.kind, self.causes)


def _unpickle_group_rejected(message: str, group_key: str, kind: str, causes: list[str]) -> GroupRejected:
    err = GroupRejected(message, group_key=group_key, kind=kind)
    err._cause_names = causes
    return err


@dataclasses.dataclass(frozen=True, kw_only=True)
class ARPOParams:
    """``strategy="arpo"`` (ARPO's entropy-adaptive branching; the published script's values). After
    every turn a live branch forks ``beam_size - 1`` copies when
    ``clip(u - entropy_weight * (H_now - H_init), 0, 1) <= branch_probability`` (``u ~ U(0, 1)``,
    ``H_init`` the entropy of its lineage's first turn) while the group budget lasts. A turn's
    entropy is the mean over its first ``entropy_tokens`` tokens of the ``top_logprobs`` (1..20)
    distribution renormalised. Validated whatever the strategy, so that a bad value fails early."""

    entropy_weight: float = 0.2
    branch_probability: float = 0.5
    beam_size: int = 2
    top_logprobs: int = 20
    entropy_tokens: int = 20

    def __post_init__(self) -> None:
        owner = type(self)
        require(self.beam_size >= 2, "beam_size", f"must be >= 2 (one copy per branching), got {self.beam_size}", owner)
        require(self.entropy_weight >= 0, "entropy_weight", f"must be >= 0, got {self.entropy_weight}", owner)
        require(0 <= self.branch_probability <= 1, "branch_probability",
                f"must be in [0, 1], got {self.branch_probability}", owner)
        require(1 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
                f"must be in [1, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}", owner)
        require(self.entropy_tokens >= 1, "entropy_tokens", f"must be >= 1, got {self.entropy_tokens}", owner)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeParams:
    """The shape of a rollout group: what a user chooses (the trainer's ``rollout`` YAML section is
    these fields and its own; :class:`TreeConfig` adds what a run supplies).

    Attributes:
      strategy: ``"flat"`` (``group_size`` independent samples), ``"dapo"`` (rolled out as flat),
        ``"tree_random"`` (random scores), ``"patr"`` (branch scorer) or ``"arpo"`` (entropy-adaptive
        branching after every turn).
      group_size: flat / dapo group size G; trees: the branch budget when ``max_branches`` is unset.
      b0: initial branches of a tree. k: turns between checkpoints. m: children per expansion.
      top_k: branches expanded per checkpoint. alpha: prune margin below the median score (the
        paper's 0.5; a branch scoring below ``median - alpha`` is pruned).
      theta: identical consecutive actions that stop a branch (``None``: never). The action is the
        env's ``info["action"]`` (FrozenLake: the parsed move, ``None`` for an invalid answer, so
        repeated invalid answers count as a loop too), else the stripped answer text.
      theta_at: ``"turn"`` (check the theta rule after every turn, every strategy) or
        ``"checkpoint"`` (the paper: only among the active branches at a tree checkpoint).
      max_branches: hard cap on live + finished branches of a tree (``None``: ``group_size``).
      keep: ``"keep_all"`` or ``"best_n"`` (drop pruned and loop-stopped branches from the group).
      refill: when every branch has ended and slots are free, branch again (see module doc; arpo:
        restart from the root, one branch per round).
      arpo: :class:`ARPOParams`.
    """

    strategy: Literal[STRATEGIES] = "patr"
    group_size: int = 8
    b0: int = 4
    k: int = 5
    m: int = 2
    top_k: int = 2
    alpha: float = 0.5
    theta: int | None = 6
    theta_at: Literal[THETA_AT] = "turn"
    max_branches: int | None = None
    keep: Literal[GROUP_MODES] = "keep_all"
    refill: bool = True
    arpo: ARPOParams = dataclasses.field(default_factory=ARPOParams)

    def __post_init__(self) -> None:
        owner = type(self)
        require(self.strategy in STRATEGIES, "strategy", f"got {self.strategy!r}; allowed: {STRATEGIES}", owner)
        require(self.keep in GROUP_MODES, "keep", f"got {self.keep!r}; allowed: {GROUP_MODES}", owner)
        require(self.theta_at in THETA_AT, "theta_at", f"got {self.theta_at!r}; allowed: {THETA_AT}", owner)
        for name in ("group_size", "b0", "k", "m", "top_k"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}", owner)
        require(self.m >= 2 or self.strategy not in SCORED_STRATEGIES, "m",
                f"an expansion needs at least 2 children, got {self.m}", owner)
        require(self.theta is None or self.theta >= 2, "theta", f"must be >= 2 or null, got {self.theta}", owner)
        require(math.isfinite(self.alpha) and self.alpha >= 0, "alpha", f"must be >= 0, got {self.alpha}", owner)
        require(self.max_branches is None or self.max_branches >= 1, "max_branches",
                f"must be >= 1 (or null: group_size), got {self.max_branches}", owner)
        require(not self.tree_mode or self.budget >= self.b0, "max_branches",
                f"the branch budget ({self.budget}) must be >= b0 ({self.b0})", owner)
        require(self.top_k <= self.b0 * 64, "top_k", f"unreasonably large ({self.top_k} for b0={self.b0})", owner)

    @property
    def tree_mode(self) -> bool:
        """Whether groups are trees (every strategy but flat and dapo)."""
        return self.strategy not in FLAT_STRATEGIES

    @property
    def budget(self) -> int:
        """Trajectories a group may hold: ``group_size`` for flat and dapo, else the branch cap
        ``max_branches`` (``group_size`` when unset)."""
        if not self.tree_mode:
            return self.group_size
        return self.max_branches or self.group_size

    @property
    def target_size(self) -> int | None:
        """Trajectories per group when every slot is used (flat, dapo: G; tree with refill: the
        budget; a tree without refill may end with fewer: ``None``)."""
        return self.budget if (not self.tree_mode or self.refill) else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TreeConfig(TreeParams):
    """How one group is rolled out: its :class:`TreeParams` and what the run supplies.

    Attributes:
      max_turns: turns per trajectory.
      sampling: request sampling options (the seed is set per request).
      max_context_tokens: stop a branch whose next prompt plus ``max_tokens`` would exceed this.
      seed: base seed for per-request seeds and Tree-Random scores.
      score_timeout_s / env_timeout_s: bounds on one scorer call / one env step.
    """

    max_turns: int = 10
    sampling: SamplingParams = SamplingParams()
    max_context_tokens: int | None = None
    seed: int = 0
    score_timeout_s: float = 60.0
    env_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.max_turns >= 1, "max_turns", f"must be >= 1, got {self.max_turns}", type(self))

    @classmethod
    def from_params(cls, params: TreeParams, **run: Any) -> TreeConfig:
        """``params``' :class:`TreeParams` fields (from any subclass, e.g. the trainer's ``rollout``
        section) with the run's fields ``run`` (``max_turns``, ``sampling``, ...)."""
        shape = {f.name: getattr(params, f.name) for f in dataclasses.fields(TreeParams)}
        return cls(**shape, **run)


@dataclasses.dataclass
class LeafRecord:
    """One trajectory of the group: the branch ending at interaction ``leaf_id``.

    ``status``: ``success`` | ``done`` (env ended without success) | ``invalid`` (env ended on an
    invalid answer) | ``max_turns`` | ``pruned`` | ``loop`` | ``context``. ``truncated``: the last response stopped on the length limit.
    """

    leaf_id: str
    branch_id: str
    outcome_reward: float
    status: str
    turns: int
    truncated: bool
    origin: str  # root | child | refill
    score: float | None = None  # last checkpoint score, if scored


@dataclasses.dataclass
class CheckpointStats:
    """One tree_random / patr checkpoint: branches active there, their scores and what became of
    them (``loop_stopped``: stopped there by the theta rule under ``theta_at="checkpoint"``, before
    scoring; ``active`` counts them, ``scores`` does not)."""

    index: int
    active: int
    scores: list[float]
    expanded: int
    children: int
    pruned: int
    survived: int
    loop_stopped: int = 0


@dataclasses.dataclass
class GroupStats:
    """Per-group accounting (every sampled action counts)."""

    strategy: str = ""
    branches_started: int = 0
    roots: int = 0
    children: int = 0
    refills: int = 0
    expanded: int = 0
    pruned: int = 0
    loop_stopped: int = 0
    context_stopped: int = 0
    completed: int = 0  # ended by the env or max_turns
    leaves: int = 0  # trajectories in the group
    successes: int = 0
    sampled_actions: int = 0  # requests = turns generated
    invalid_actions: int = 0  # turns the env rejected (``info["valid"] is False``)
    generated_tokens: int = 0
    prompt_tokens: int = 0
    cache_reusable_tokens: int = 0  # prompt tokens an ideal prefix cache already holds
    sibling_shared_tokens: int = 0  # of those, the ones only a sibling's request put there
    branch_decisions: int = 0  # arpo: u draws (one per live branch per round while slots remained)
    entropy_mean: float | None = None  # arpo: mean turn entropy over the group's turns (nats)
    wall_s: float = 0.0
    http_s: float = 0.0
    overhead_s: float = 0.0  # synchronous rollout work per turn (template diff, env, bookkeeping)
    checkpoints: list[CheckpointStats] = dataclasses.field(default_factory=list)

    @property
    def any_success(self) -> bool:
        return self.successes > 0

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["any_success"] = self.any_success
        return d


@dataclasses.dataclass
class GroupResult:
    """A rolled-out group. ``leaves`` is the training group (``keep`` applied);
    ``all_leaves`` also holds the dropped ones. ``tree`` holds every interaction.
    ``process_rewards``: once scored (``rollout.scoring.score_groups``), the scorers' token rewards
    of every training leaf, ``{leaf_id: {interaction_id: float32[output_len]}}``; they ride on the
    group through filters, staleness drops, the multi-host gather and the export."""

    group_key: str
    task: Any
    tree: InteractionTree
    leaves: list[LeafRecord]
    all_leaves: list[LeafRecord]
    stats: GroupStats
    process_rewards: ProcessRewards | None = None

    def with_process_rewards(self, rewards: ProcessRewards | None) -> GroupResult:
        """This group carrying ``rewards`` (a copy; the group itself is unchanged)."""
        return dataclasses.replace(self, process_rewards=rewards)


@dataclasses.dataclass
class _Branch:
    id: str
    env: Env
    messages: list[dict[str, Any]]
    prompt: list[int]
    last_id: str | None
    depth: int
    actions: list[Any]
    reward: float
    origin: str
    lineage_len: int = 0  # prompt+output tokens of the previous request on this lineage
    status: str | None = None
    score: float | None = None
    truncated: bool = False
    h_init: float | None = None  # arpo: entropy of the lineage's first turn
    h_now: float | None = None  # arpo: entropy of the last turn

    def fork(self, new_id: str, origin: str) -> _Branch:
        return _Branch(id=new_id, env=self.env.clone(), messages=list(self.messages), prompt=list(self.prompt),
                       last_id=self.last_id, depth=self.depth, actions=list(self.actions), reward=self.reward,
                       origin=origin, lineage_len=self.lineage_len, score=self.score, h_init=self.h_init,
                       h_now=self.h_now)

    def loops(self, theta: int | None) -> bool:
        """Whether the last ``theta`` actions are identical (the theta rule; ``None``: never)."""
        return theta is not None and len(self.actions) >= theta and len(set(map(repr, self.actions[-theta:]))) == 1

    def entropy_delta(self) -> float:
        """``H_now - H_init`` (0 when either is unknown)."""
        if self.h_now is None or self.h_init is None:
            return 0.0
        return self.h_now - self.h_init


def request_seed(*parts: Any) -> int:
    """The sampling seed of one request: ``crc32(":".join(map(str, parts))) & 0x7FFFFFFF``. A tree
    branch's turn uses ``(config seed, group seed, branch id, depth)``; the recording proxy's seeded
    sessions use the same parts, so both paths sample a flat group alike."""
    return zlib.crc32(":".join(map(str, parts)).encode()) & 0x7FFFFFFF


_seed = request_seed


async def _gather(coros: Sequence[Any]) -> list[Any]:
    """Run concurrently; on the first failure cancel the rest and raise it (cancellation propagates).

    The error is raised as its raiser built it: outside the ``except`` block, so Python neither
    overwrites its ``__cause__`` (the scorer's error under a :class:`GroupRejected`) nor sets the
    TaskGroup's ``ExceptionGroup`` as its context."""
    tasks: list[asyncio.Task] = []
    first: BaseException | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        errs = [e for e in eg.exceptions if not isinstance(e, asyncio.CancelledError)]
        first = errs[0] if errs else eg.exceptions[0]
    if first is not None:
        raise first
    return [t.result() for t in tasks]


class _GroupRun:
    def __init__(self, task: Any, env_factory: Callable[[], Env], client: GenerationClient, prompts: PromptBuilder,
                 config: TreeConfig, scorer: BaseScorer | None, group_seed: int, group_key: str):
        self.task, self.env_factory, self.client, self.prompts = task, env_factory, client, prompts
        self.cfg, self.scorer, self.group_seed, self.key = config, scorer, group_seed, group_key
        self.tree = InteractionTree()
        self.stats = GroupStats(strategy=config.strategy)
        self.finished: list[_Branch] = []
        self.snapshots: list[tuple[float, int, _Branch]] = []  # (score, order, frozen fork)
        self._n_branches = 0
        self._sent_from: set[str | None] = set()
        self._root: _Branch | None = None
        self._arpo = config.strategy == "arpo"
        self._sampling = (dataclasses.replace(config.sampling, top_logprobs=config.arpo.top_logprobs)
                          if self._arpo else config.sampling)
        self._entropies: list[float] = []  # arpo: every turn's entropy

    # ------------------------------------------------------------------ branches

    def _new_id(self) -> str:
        bid = f"b{self._n_branches}"
        self._n_branches += 1
        self.stats.branches_started += 1
        return bid

    async def _root_branch(self, origin: str = "root") -> _Branch:
        if self._root is None:
            env = self.env_factory()
            obs = await asyncio.wait_for(env.reset(self.task), self.cfg.env_timeout_s)
            system = env.system_prompt(self.task)
            msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": obs}]
            self._root = _Branch(id="root", env=env, messages=msgs, prompt=self.prompts.initial(msgs), last_id=None,
                                 depth=0, actions=[], reward=0.0, origin="root")
        b = self._root.fork(self._new_id(), origin)
        if origin == "root":
            self.stats.roots += 1
        else:
            self.stats.refills += 1
        return b

    def _fork(self, parent: _Branch, origin: str) -> _Branch:
        child = parent.fork(self._new_id(), origin)
        if origin == "refill":
            self.stats.refills += 1
        else:
            self.stats.children += 1
        return child

    async def _turn(self, b: _Branch) -> None:
        cfg = self.cfg
        params = dataclasses.replace(self._sampling, seed=_seed(cfg.seed, self.group_seed, b.id, b.depth))
        # Prefix-cache accounting: identical prompts share their parent interaction id.
        plen = len(b.prompt)
        if b.last_id in self._sent_from and plen > b.lineage_len:
            self.stats.sibling_shared_tokens += plen - b.lineage_len
            self.stats.cache_reusable_tokens += plen
        else:
            self.stats.cache_reusable_tokens += min(b.lineage_len, plen)
        self._sent_from.add(b.last_id)
        gen = await self.client.generate(b.prompt, params, route_key=self.key)
        t0 = time.perf_counter()
        resp = gen.response
        if resp.input_tokens.tolist() != b.prompt:
            raise RolloutError(f"branch {b.id}: the response's prompt differs from the prompt sent")
        text = gen.text if gen.text is not None else self.prompts.tokenizer.decode(resp.output_tokens)
        self.stats.sampled_actions += 1
        self.stats.generated_tokens += resp.output_len
        self.stats.prompt_tokens += plen
        self.stats.http_s += gen.http_s
        if self._arpo:
            self._record_entropy(b, gen)
        t1 = time.perf_counter()
        step = await asyncio.wait_for(b.env.step(text), cfg.env_timeout_s)
        t2 = time.perf_counter()
        inter = Interaction(id=f"{self.key}/{b.id}/t{b.depth}", parent_id=b.last_id, messages=b.messages,
                            output_messages=[{"role": "assistant", "content": text}], model_response=resp,
                            reward=float(step.reward), env_state=dict(step.info))
        self.tree.add(inter)
        b.last_id = inter.id
        b.depth += 1
        b.reward += float(step.reward)
        b.truncated = resp.truncated
        b.actions.append(step.info.get("action", text.strip()))
        if step.info.get("valid") is False:
            self.stats.invalid_actions += 1
        b.lineage_len = plen + resp.output_len
        if step.done:
            if step.info.get("success"):
                b.status = "success"
            elif step.info.get("truncated"):
                b.status = "max_turns"
            else:  # the env ended it: on an invalid answer (info["valid"] False) or otherwise (a hole)
                b.status = "invalid" if step.info.get("valid") is False else "done"
        elif b.depth >= cfg.max_turns:
            b.status = "max_turns"
        elif cfg.theta_at == "turn" and b.loops(cfg.theta):
            b.status = "loop"
        else:
            new_msgs = [{"role": step.role, "content": step.observation}]
            tail = self.prompts.continuation(b.messages, text, new_msgs, resp.output_tokens)
            new_prompt = b.prompt + resp.output_tokens.tolist() + [int(t) for t in tail]
            check_extends(b.prompt, new_prompt)
            b.messages = [*b.messages, {"role": "assistant", "content": text}, *new_msgs]
            b.prompt = new_prompt
            if cfg.max_context_tokens is not None and len(new_prompt) + cfg.sampling.max_tokens > cfg.max_context_tokens:
                b.status = "context"
        self.stats.overhead_s += (t1 - t0) + (time.perf_counter() - t2) + gen.client_s

    def _record_entropy(self, b: _Branch, gen: Generated) -> None:
        """arpo: the turn's entropy (mean over its first ``arpo.entropy_tokens`` tokens) becomes
        ``b.h_now``, and ``b.h_init`` when it is the lineage's first."""
        if gen.entropies is None:
            raise RolloutError(f"group {self.key!r}: strategy 'arpo' needs per-token entropies, but the server "
                               "answered without top logprobs (vLLM logprobs: n / SGLang top_logprobs_num)")
        head = [h for h in gen.entropies[: self.cfg.arpo.entropy_tokens] if math.isfinite(h)]
        if not head:  # no alternatives listed: no entropy signal for this turn
            b.h_now = None
            return
        b.h_now = sum(head) / len(head)
        self._entropies.append(b.h_now)
        if b.h_init is None:
            b.h_init = b.h_now

    async def _advance(self, b: _Branch, turns: int) -> None:
        for _ in range(turns):
            await self._turn(b)
            if b.status is not None:
                return

    # ------------------------------------------------------------------ scoring

    async def _score_one(self, b: _Branch) -> float:
        branch = self.tree.branch(b.last_id)  # score_branch works on private copies
        ctx = {"task": self.task, "branch_id": b.id}
        where = f"group {self.key!r}: branch {b.id} at turn {b.depth}"
        try:
            s = await asyncio.wait_for(score_branch(self.scorer, branch, messages=branch_messages(branch), ctx=ctx),
                                       self.cfg.score_timeout_s)
        except ScoringRejected as e:
            raise GroupRejected(f"{where}: {e.reason}", group_key=self.key, kind=e.kind) from e
        except TimeoutError:
            raise GroupRejected(f"{where}: the branch scorer took longer than {self.cfg.score_timeout_s} s",
                                group_key=self.key, kind="timeout") from None
        if not 0.0 <= s <= 1.0:
            raise GroupRejected(f"{where}: branch score {s} is outside [0, 1]", group_key=self.key, kind="out_of_range")
        return s

    async def _scores(self, active: list[_Branch], index: int) -> list[float]:
        if self.cfg.strategy == "tree_random":
            rng = np.random.default_rng([self.cfg.seed, self.group_seed, index])
            return [float(x) for x in rng.random(len(active))]
        if self.scorer is None:
            raise ValueError("strategy 'patr' needs a branch scorer")
        return await _gather([self._score_one(b) for b in active])

    # ------------------------------------------------------------------ main loop

    def _free_slots(self, n_active: int) -> int:
        return self.cfg.budget - n_active - len(self.finished)

    def _collect(self, active: list[_Branch]) -> list[_Branch]:
        alive = []
        for b in active:
            if b.status is None:
                alive.append(b)
                continue
            self.finished.append(b)
            if b.status == "loop":
                self.stats.loop_stopped += 1
            elif b.status == "context":
                self.stats.context_stopped += 1
            else:
                self.stats.completed += 1
        return alive

    def _stop_loops(self, active: list[_Branch]) -> list[_Branch]:
        """theta_at="checkpoint": end the looping branches of ``active`` (status "loop"); the rest."""
        for b in active:
            if b.loops(self.cfg.theta):
                b.status = "loop"
        return self._collect(active)

    async def _checkpoint(self, active: list[_Branch], index: int) -> list[_Branch]:
        cfg = self.cfg
        n_looped = 0
        if cfg.theta_at == "checkpoint":
            n_before = len(active)
            active = self._stop_loops(active)
            n_looped = n_before - len(active)
            if not active:
                self.stats.checkpoints.append(CheckpointStats(index=index, active=n_before, scores=[], expanded=0,
                                                              children=0, pruned=0, survived=0,
                                                              loop_stopped=n_looped))
                return []
        scores = await self._scores(active, index)
        for b, s in zip(active, scores):
            b.score = s
        order = sorted(range(len(active)), key=lambda i: (-scores[i], i))
        free = self._free_slots(len(active))
        expand: list[int] = []
        n_children: dict[int, int] = {}
        for i in order[: cfg.top_k]:
            n = int(min(cfg.m, 1 + free))
            if n < 2:
                break
            expand.append(i)
            n_children[i] = n
            free -= n - 1
        med = statistics.median(scores)
        pruned = [i for i in range(len(active)) if i not in n_children and scores[i] < med - cfg.alpha]
        nxt: list[_Branch] = []
        for i, b in enumerate(active):
            if i in n_children:
                self.snapshots.append((scores[i], len(self.snapshots), b.fork("snapshot", "refill")))
                nxt.extend(self._fork(b, "child") for _ in range(n_children[i]))
            elif i in pruned:
                b.status = "pruned"
                self.finished.append(b)
            else:
                self.snapshots.append((scores[i], len(self.snapshots), b.fork("snapshot", "refill")))
                nxt.append(b)
        self.stats.expanded += len(expand)
        self.stats.pruned += len(pruned)
        self.stats.checkpoints.append(CheckpointStats(
            index=index, active=len(active) + n_looped, scores=list(scores), expanded=len(expand),
            children=sum(n_children.values()), pruned=len(pruned), survived=len(active) - len(expand) - len(pruned),
            loop_stopped=n_looped))
        return nxt

    def _arpo_branch(self, live: list[_Branch], index: int) -> list[_Branch]:
        """arpo, after round ``index``: each live branch in order, while slots remain, draws
        ``u ~ U(0, 1)`` and forks ``min(beam_size - 1, free)`` children (placed right after it) when
        ``clip(u - w * (H_now - H_init), 0, 1) <= arpo.branch_probability``."""
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, self.group_seed, index])
        free = int(self._free_slots(len(live)))
        nxt: list[_Branch] = []
        for b in live:
            nxt.append(b)
            if free <= 0:
                continue
            self.stats.branch_decisions += 1
            p = min(max(float(rng.random()) - cfg.arpo.entropy_weight * b.entropy_delta(), 0.0), 1.0)
            if p > cfg.arpo.branch_probability:
                continue
            n = min(cfg.arpo.beam_size - 1, free)
            nxt.extend(self._fork(b, "child") for _ in range(n))
            free -= n
            self.stats.expanded += 1
        return nxt

    async def _between(self, active: list[_Branch], index: int) -> list[_Branch]:
        """What a tree does with its live branches after an interval: arpo branches, the others checkpoint."""
        if self._arpo:
            return self._arpo_branch(active, index)
        return await self._checkpoint(active, index)

    async def _refill(self) -> list[_Branch]:
        if self._arpo:
            return [await self._root_branch("refill")]
        free = int(self._free_slots(0))
        if not self.snapshots:
            return [await self._root_branch("refill") for _ in range(min(free, self.cfg.b0))]
        best = sorted(self.snapshots, key=lambda s: (-s[0], s[1]))[: self.cfg.top_k]
        n = min(free, self.cfg.b0)
        return [self._fork(best[j % len(best)][2], "refill") for j in range(n)]

    async def run(self) -> GroupResult:
        cfg = self.cfg
        t_start = time.perf_counter()
        tree_mode = cfg.tree_mode
        n0 = cfg.b0 if tree_mode else cfg.group_size
        active = [await self._root_branch() for _ in range(n0)]
        interval = (1 if self._arpo else cfg.k) if tree_mode else cfg.max_turns
        index = 0
        while True:
            if active:
                await _gather([self._advance(b, interval) for b in active])
                active = self._collect(active)
                if active and tree_mode:
                    active = await self._between(active, index)
                    index += 1
            if not active:
                if tree_mode and cfg.refill and self._free_slots(0) > 0:
                    active = await self._refill()
                    continue
                break
        if self._entropies:
            self.stats.entropy_mean = math.fsum(self._entropies) / len(self._entropies)  # order-independent
        self.stats.wall_s = time.perf_counter() - t_start
        all_leaves = [LeafRecord(leaf_id=b.last_id, branch_id=b.id, outcome_reward=b.reward, status=b.status,
                                 turns=b.depth, truncated=b.truncated, origin=b.origin, score=b.score)
                      for b in self.finished if b.last_id is not None]
        group = [lf for lf in all_leaves
                 if cfg.keep == "keep_all" or lf.status not in DROPPED_UNDER_BEST_N]
        self.stats.leaves = len(group)
        self.stats.successes = sum(1 for lf in group if lf.status == "success")
        return GroupResult(group_key=self.key, task=self.task, tree=self.tree, leaves=group, all_leaves=all_leaves,
                           stats=self.stats)


async def run_group(task: Any, *, env_factory: Callable[[], Env], client: GenerationClient,
                    prompts: PromptBuilder | ChatTokenizer, config: TreeConfig, scorer: BaseScorer | None = None,
                    group_seed: int = 0, group_key: str | None = None) -> GroupResult:
    """Roll out one group for ``task`` with ``config.strategy`` (see the module docstring).

    Args:
      task: passed to ``env.reset``.
      env_factory: makes a fresh env (one per group; children use ``env.clone()``).
      client: the generation client (requests use ``group_key`` as the sticky route key).
      prompts: a :class:`PromptBuilder`, or a tokenizer to build one from.
      config: the strategy and its parameters.
      scorer: the branch scorer (required for ``"patr"``): a ``scorers.BaseScorer`` whose reward for a
        partial branch's last turn (mean over its tokens) must lie in [0, 1]; scored through
        ``scorers.score_branch``, the same isolation and validation as export-time scoring.
        Other strategies ignore it (``"arpo"`` branches on the server's token entropies instead, so
        its server must answer top logprobs).
      group_seed: distinguishes groups (and steps) for per-request seeds.
      group_key: prefix of interaction ids and the route key; default ``f"g{group_seed}"``.

    Raises ``ValueError`` for a bad call (``"patr"`` without a scorer) before anything runs;
    :class:`GroupRejected` if the branch scorer rejects a checkpoint; :class:`RolloutError` (with the
    cause chained) if anything else fails during the rollout (a request, an env step, the prompt
    chain); the other branches are cancelled first. Cancelling the caller cancels every branch.
    """
    if not isinstance(prompts, PromptBuilder):
        prompts = PromptBuilder(prompts)
    if config.strategy == "patr" and scorer is None:
        raise ValueError("strategy 'patr' needs a branch scorer (scorer=...)")
    key = group_key if group_key is not None else f"g{group_seed}"
    run = _GroupRun(task, env_factory, client, prompts, config, scorer, group_seed, key)
    try:
        return await run.run()
    except (asyncio.CancelledError, RolloutError):
        raise
    except Exception as e:  # an env, the server or the tokenizer failed mid-rollout (ValueError included)
        raise RolloutError(f"group {key!r} failed: {type(e).__name__}: {e}") from e
    finally:
        client.release(key)


async def run_groups(tasks: Sequence[Any], *, rejected: list[GroupRejected] | None = None,
                     **kwargs: Any) -> list[GroupResult]:
    """``run_group`` for several tasks concurrently; group ``i`` uses ``group_seed = base + i``
    where ``base = kwargs.pop("group_seed", 0)``, and key ``f"g{group_seed}"``.

    With ``rejected`` (a list), a group that its branch scorer rejects is left out of the result and
    its :class:`GroupRejected` appended there (the other groups go on); without it, it is raised.
    Any other failure cancels every group and is raised."""
    base = kwargs.pop("group_seed", 0)

    async def one(i: int, task: Any) -> GroupResult | None:
        try:
            return await run_group(task, group_seed=base + i, **kwargs)
        except GroupRejected as e:
            if rejected is None:
                raise
            rejected.append(e)
            return None

    results = await _gather([one(i, t) for i, t in enumerate(tasks)])
    return [g for g in results if g is not None]
