"""What a group rollout is given and what it gives back (layer 4): its shape and settings
(:class:`TreeParams`, :class:`ARPOParams`, :class:`TreeConfig`), its trajectories and accounting
(:class:`LeafRecord`, :class:`CheckpointStats`, :class:`GroupStats`, :class:`GroupResult`), its
errors, and the per-request seed. ``rollout.tree`` runs groups; ``rollout.strategies`` holds what each
strategy does between intervals."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from jaxprm.fields import require
from rollout.dialects import MAX_TOP_LOGPROBS, SamplingParams
from rollout.types import InteractionTree

__all__ = [
    "request_seed",
    "TreeConfig",
    "TreeParams",
    "ARPOParams",
    "LeafRecord",
    "CheckpointStats",
    "GroupStats",
    "GroupResult",
    "ProcessRewards",
    "RolloutError",
    "GroupRejected",
    "STRATEGIES",
    "FLAT_STRATEGIES",
    "SCORED_STRATEGIES",
    "GROUP_MODES",
    "THETA_AT",
    "DROPPED_UNDER_BEST_N",
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

    strategy: Literal[STRATEGIES] = "flat"  # the best measured (docs/results.md, issue 36)
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


def request_seed(*parts: Any) -> int:
    """The sampling seed of one request: ``crc32(":".join(map(str, parts))) & 0x7FFFFFFF``. A tree
    branch's turn uses ``(config seed, group seed, branch id, depth)``; the recording proxy's seeded
    sessions use the same parts, so both paths sample a flat group alike."""
    return zlib.crc32(":".join(map(str, parts)).encode()) & 0x7FFFFFFF

