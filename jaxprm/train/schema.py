"""The trainer's YAML schema: one dataclass per section, with the defaults of the embedded default
run (``python -m jaxprm.train`` with no config). Loading, overrides and validation are in
:mod:`jaxprm.train.config`, which re-exports every name here."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from jaxprm.fields import FieldError, require
from jaxprm.learner.advantages import ESTIMATORS, AdvantageParams
from jaxprm.models.lora import LoraConfig
from jaxprm.modes import BEHAVIOUR_WEIGHT_MODES, LOSS_AGGREGATIONS
from jaxprm.serve.serving import ServeConfig
from rollout.client import DIALECTS, ClientConfig
from rollout.groups import ARPOParams, TreeParams
from scorers import AdvantageShapingConfig, PRMConfig, ScorerSpec

__all__ = [
    "ModelConfig",
    "ServerConfig",
    "BranchScorerSpec",
    "ARPOConfig",
    "DAPOConfig",
    "RolloutConfig",
    "EnvConfig",
    "AgentConfig",
    "ScorerSpec",
    "ShapingConfig",
    "PRMSection",
    "AdvantageSection",
    "OptimizerConfig",
    "PPOConfig",
    "WarmStartConfig",
    "EvalConfig",
    "CheckpointConfig",
    "CompileCacheConfig",
    "MeshConfig",
    "DistributedConfig",
    "TrainConfig",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The policy. ``name`` is a preset (``tiny``, ``smollm2-135m``) or a path to an HF directory
    or a ``.gguf`` file. ``overrides`` are passed to the tiny preset's architecture (e.g. layers).
    ``lora`` (``rank``, ``alpha``, ``targets``): with ``rank > 0`` only adapters are trained,
    optimized and checkpointed; servers, evaluation and the exported model get merged weights."""

    name: str = "tiny"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # the learner's matmul dtype: bfloat16 casts the params on the way into each forward (master
    # params, gradients and optimizer state stay in ``dtype``; logits and the loss math stay float32)
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    # rank > 0: train LoRA adapters (nnx.LoRA) on lora.targets, the weights frozen (jaxprm.models.LoraConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Generation server: ``embedded`` starts ``jaxprm.serve`` in-process on a free loopback port
    (with a random API key that only the trainer's client knows; ``/update_weights_from_disk``
    limited to the run directory); ``external`` talks to running vLLM / SGLang servers at ``urls``.

    ``warn_behavior_kl`` / ``max_behavior_kl``: a train row's ``behavior_kl`` (the sampler's
    log-probs against the learner's, before the step's first update; ~0 when the server serves the
    learner's policy) above the first logs a warning, above the second stops the run with an error
    (``null``: never stop).

    ``unavailable_timeout_s``: an external server that stops answering is taken out of rotation and
    its requests go to the others; when every server has been down this long the run stops with one
    line (restart them and ``--resume``). A server that comes back gets the current weights and must
    report their ``weight_version`` before it serves again."""

    kind: Literal["embedded", "external"] = "embedded"
    urls: list[str] = dataclasses.field(default_factory=list)
    dialect: Literal[DIALECTS] = "vllm"
    model_name: str | None = None
    api_key: str | None = None
    token_backed: bool = True
    timeout_s: float = 120.0
    max_retries: int = 3
    concurrency: int = 64
    max_batch: int = 64
    # embedded: the engine's shape buckets. Each (batch, KV window) pair is a decode program and each
    # (rows, chunk, window) a prefill program to compile (~1.5 s each for the tiny model on 2 cores);
    # x4 steps instead of x2 halve the programs a run compiles, for a little padding.
    batch_buckets: list[int] = dataclasses.field(default_factory=lambda: [1, 4, 16, 64])
    window_factor: float = 4
    # embedded: chunked prefill (prompt tokens per sequence / padded tokens per call). Chunks are
    # bucketed 16, 64, ... up to prefill_chunk and rows 1, 4, 16, ... up to max_prefill_tokens / 16;
    # a FrozenLake turn's new suffix is ~40 tokens (the prefix cache holds the rest), so 64 / 256
    # serve it with fewer (rows, chunk, window) programs than the standalone server's 256 / 1024.
    prefill_chunk: int = 64
    max_prefill_tokens: int = 256
    batch_window_ms: float = 5.0
    weight_sync_dir: str | None = None  # external: where the policy is saved for /update_weights_from_disk
    unavailable_timeout_s: float = 300.0
    warn_behavior_kl: float = 0.05
    max_behavior_kl: float | None = 1.0

    def __post_init__(self) -> None:
        """Checks its own keys; what the client and the engine take is checked by building their
        configs (``ClientConfig`` and ``ServeConfig`` validate themselves), with their errors
        renamed to this section's keys."""
        owner = type(self)
        require(self.kind == "embedded" or bool(self.urls), "urls",
                "an external server needs at least one URL (http://host:port)", owner)
        require(bool(self.batch_buckets) and all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                                 for b in self.batch_buckets),
                "batch_buckets", f"must be a non-empty list of positive ints, got {self.batch_buckets!r}", owner)
        require(math.isfinite(self.batch_window_ms) and self.batch_window_ms >= 0, "batch_window_ms",
                f"must be >= 0, got {self.batch_window_ms!r}", owner)
        for name in ("warn_behavior_kl", "max_behavior_kl"):
            value = getattr(self, name)
            require(value is None or (math.isfinite(value) and value >= 0), name, f"must be >= 0, got {value!r}", owner)
        require(self.max_behavior_kl is None or self.warn_behavior_kl <= self.max_behavior_kl, "warn_behavior_kl",
                f"must be <= max_behavior_kl ({self.max_behavior_kl}), got {self.warn_behavior_kl}", owner)
        try:
            self.client_config(self.urls or ["http://127.0.0.1"], api_key=None)
            self.serve_config(api_key=None)
        except FieldError as e:
            name, bracket, index = e.field.partition("[")  # endpoints[1] -> urls[1]
            raise FieldError(_SERVER_KEYS.get(name, name) + bracket + index, e.message, owner) from None

    def client_config(self, urls: list[str], *, api_key: str | None) -> ClientConfig:
        """The rollout client's config: calls ``urls`` (the embedded server's or ``self.urls``)."""
        return ClientConfig(endpoints=tuple(urls), dialect=self.dialect, model=self.model_name or "jaxprm",
                            api_key=api_key, timeout_s=self.timeout_s, max_retries=self.max_retries,
                            max_concurrency=self.concurrency, require_tokens=self.token_backed,
                            unavailable_timeout_s=self.unavailable_timeout_s)

    def serve_config(self, *, api_key: str | None, weights_roots: tuple[str, ...] = ()) -> ServeConfig:
        """The embedded server's config (served as ``jaxprm``; loads weights only under ``weights_roots``)."""
        return ServeConfig(model_name="jaxprm", api_key=api_key, weights_roots=weights_roots,
                           max_batch=self.max_batch, collect_window_s=self.batch_window_ms / 1000.0,
                           window_factor=self.window_factor, prefill_chunk=self.prefill_chunk,
                           max_prefill_tokens=self.max_prefill_tokens)


#: The ``server`` key of each client / engine option whose library name differs (the YAML keys came first).
_SERVER_KEYS = {"endpoints": "urls", "model": "model_name", "max_concurrency": "concurrency",
                "require_tokens": "token_backed"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BranchScorerSpec:
    """PaTR's branch scorer: a ``scorers.BaseScorer`` class path and its constructor kwargs (the form of
    a ``prm.scorers`` entry). Its reward for a partial branch's last turn must lie in [0, 1]; e.g.
    ``scorers.LLMJudgeScorer`` (PaTR-Judge) or ``scorers.PRMModelScorer`` (PaTR-PRM)."""

    path: str = "scorers.FrozenLakeProgressScorer"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


ARPOConfig = ARPOParams  # rollout.arpo: the library's own section (rollout.groups.ARPOParams)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DAPOConfig:
    """DAPO's rollout-side pieces (its clip-higher and token-level loss are ``ppo.eps_clip_higher``
    and ``ppo.agg``, on by default for every strategy).

    ``dynamic_sampling`` (null: on for ``rollout.strategy: dapo`` only): groups whose trajectories
    all succeed or all fail are dropped and more tasks are rolled out, ``tasks_per_step`` at a time
    for at most ``max_rounds`` rounds, until ``tasks_per_step`` groups remain (the surplus is cut;
    fewer when the rounds run out). ``max_tokens_per_step`` (null: no cap) bounds what the rounds
    may sample: no round starts once the step's generated tokens reach it, and a later round takes
    only the tasks the rest of the cap buys at the step's tokens per task so far (an equal-cost
    comparison: ``benchmarks.frozenlake`` sets it to flat GRPO's tokens per step).
    ``overlong_buffer`` (null: ``max_new_tokens // 4`` for ``dapo``,
    off otherwise; 0: off): DAPO's soft overlong punishment, applied to a trajectory by its longest
    turn ``L`` of at most ``L_max = max_new_tokens`` tokens:
    ``-factor * clip((L - (L_max - buffer)) / buffer, 0, 1)``."""

    dynamic_sampling: bool | None = None
    max_rounds: int = 3
    max_tokens_per_step: int | None = None
    overlong_buffer: int | None = None
    overlong_factor: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig(TreeParams):
    """Rollout groups: one group (tree) per task, ``tasks_per_step`` groups per training step.

    The group's shape (``strategy``, ``group_size``, ``b0``, ``k``, ``m``, ``top_k``, ``alpha``,
    ``theta``, ``theta_at``, ``max_branches``, ``keep``, ``refill``, ``arpo``) is
    :class:`rollout.groups.TreeParams`, declared, defaulted and validated there once; this section
    adds what the trainer does with the groups.

    ``alpha``, the prune margin below the median score (the paper's 0.5): with the default branch
    scorer (FrozenLake progress, level mode, reward_weight w = 0.5) a live branch scores
    0.5 * progress, in [0, 1 - w], so alpha >= 1 - w can never prune; the README's weak-start
    regime uses 0.08, just under one move of progress on a 4x4 map (0.5 / 6).

    ``source``: ``tree`` (the env is driven by ``rollout.tree``: flat / tree_random / patr) or
    ``agent`` (an OpenAI-SDK agent, the ``agent`` section, runs against the recording proxy; flat
    groups of ``group_size`` sessions only: PaTR must fork environment states, so it stays on the
    tree path)."""

    source: Literal["tree", "agent"] = "tree"
    # 16 groups of 8 (was 8): half the gradient noise, which is what lets the default lr be 6e-4
    tasks_per_step: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    # concat: one row per leaf (the spec's concat export; "individual", one row per turn, is not offered);
    # tree_packed (default): the same rows, but the learner forwards each group's shared prefixes once
    # (the same loss and gradients to float32 rounding; a step whose flat rows are estimated at least
    # 10% cheaper trains on them: jaxprm.train.packed.prefer_packed). On PaTR groups of the default
    # settings its step is 3.55x faster (learner_cpu.json).
    export: Literal["concat", "tree_packed"] = "tree_packed"
    filter: Literal[
        "none", "mixed_or_penalized_all_wrong", "mixed_or_penalized_all_wrong_mask_no_eos"
    ] = "none"
    branch_scorer: BranchScorerSpec = dataclasses.field(default_factory=lambda: BranchScorerSpec())
    # Asynchronous rollouts (jaxprm.train.overlap): the next steps' groups are rolled out while the
    # learner trains, with the newest weights the server has. A step's groups may be at most
    # max_staleness weight versions behind the learner when it learns from them: rollouts wait past
    # that, and a group found staler (its oldest token) is dropped and counted. Use it with
    # ppo.decoupled, which corrects for the staleness. max_staleness 0 is the synchronous loop.
    asynchronous: bool = False
    max_staleness: int = 1
    dapo: DAPOConfig = dataclasses.field(default_factory=lambda: DAPOConfig())


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """The environment: ``name`` is ``frozenlake`` (default) or ``sokoban`` (``rollout.envs.get_env``).

    FrozenLake: maps of ``size`` x ``size`` with hole probability ``p``. ``random_start_goal``: False
    (default) is gymnasium's layout, start top-left and goal bottom-right; True puts start and goal
    on two random distinct cells (much harder for a small policy: the right move then depends on
    locating both P and G in the text map).

    Sokoban: generated rooms of ``size`` x ``size`` cells (5 to 10; the grid's edge is a wall) with
    ``boxes`` boxes (1 to 3), each solvable in at least ``min_distance`` moves (``rollout.envs.sokoban``).

    ``system_prompt``: ``compact`` (default; ~40 tokens instead of ~140 with the tiny tokenizer,
    which matters because every turn re-reads the whole history), ``full`` (the verbose rules, for
    instruct models) or ``none``.

    ``invalid_ends_episode``: an answer without a valid fenced move ends the episode (default).
    With false it is a no-op turn, which GRPO learned to exploit as a "safe move" on FrozenLake (the
    tiny policy's invalid rate rose from 1% to 16-20% within 20 steps and success fell).

    ``action_format``: ``fenced`` (default; the move in a ```` ```Up``` ```` block) or ``tool_call``
    (a ``move(direction)`` function tool in the Hermes format, for templates that render tools:
    ``rollout.envs.tool_moves``); rollouts, evaluation, the warm start and the proxy's tool agent
    (``rollout.agents.frozenlake_tools``) all use it."""

    name: Literal["frozenlake", "sokoban"] = "frozenlake"
    action_format: Literal["fenced", "tool_call"] = "fenced"
    system_prompt: Literal["compact", "full", "none"] = "compact"
    invalid_ends_episode: bool = True
    size: int = 4
    p: float = 0.8  # probability that a cell is frozen (gymnasium's convention)
    max_turns: int = 10
    random_start_goal: bool = False
    boxes: int = 1  # sokoban
    min_distance: int = 2  # sokoban
    train_tasks: int = 2048
    eval_tasks: int = 64
    seed: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Agent rollouts through the recording proxy (``rollout.source: agent``).

    ``workflow``: ``package.module:function``, an ``async run(task, base_url, api_key, http_client,
    **kwargs)`` written against the official ``openai`` SDK (``rollout.proxy.workflow``); ``kwargs``
    are passed to it. ``timeout_s`` bounds one agent run; ``concurrency`` agents run at once.
    ``discount``: the export's backward reward discount. ``chat_template_type``: ``concat`` (required
    with process-reward scorers) or ``hf``. ``session_timeout_s``: idle sessions are swept.
    ``processes``: 0 runs the agents on the trainer's event loop; ``N`` runs them in N child processes
    (``rollout.proxy.agent_process``; groups round-robin), so that their SDK work does not share the
    trainer's interpreter lock with the proxy and the embedded engine."""

    workflow: str = "rollout.agents.frozenlake_chat:run"
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeout_s: float = 600.0
    concurrency: int = 64
    discount: float = 1.0
    chat_template_type: Literal["concat", "hf"] = "concat"
    session_timeout_s: float = 3600.0
    processes: int = 0


# a prm.scorers entry is the scorers' own scorers.ScorerSpec (imported above, re-exported)
ShapingConfig = AdvantageShapingConfig  # prm.advantage_shaping: the scorers' own (scorers.AdvantageShapingConfig)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PRMSection(PRMConfig):
    """Process-reward scoring of finished branches (``scorers.PRMRunner``): :class:`scorers.PRMConfig`,
    declared, defaulted and validated there, with one default changed: scoring is off unless asked
    for. ``max_concurrent_sessions`` counts groups scored at once (the branches of a group in order);
    ``timeout_s`` bounds scoring one group (past it the group is rejected).

    ``unavailable_wait_s``: when groups are refused because a scorer server is down
    (``scorer_unavailable``; no other rejection than that or ``failed`` calls), those groups are
    scored again after a pause (0.5 s doubling to 5 s) instead of being dropped -- a step whose every
    group is refused would pass without an update -- for up to this many seconds; then the run stops
    with one line (``--resume`` continues). ``null``: they are dropped and the run goes on."""

    enabled: bool = False
    unavailable_wait_s: float | None = 300.0

    def __post_init__(self) -> None:
        super().__post_init__()
        w = self.unavailable_wait_s
        require(w is None or (isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0),
                "unavailable_wait_s", f"must be >= 0 or null, got {w!r}", type(self))


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageSection(AdvantageParams):
    """Reward processing and advantages: :class:`jaxprm.learner.AdvantageParams`, declared,
    defaulted and validated there (the shaping mode and its numbers come from
    ``prm.advantage_shaping``). Two defaults differ, on purpose: the trainer's groups are GRPO
    groups, so their outcome rewards are normalized within the group; and the trainer's estimator
    is ``anchor_state`` (GiGPO's step groups over identical states, which flat groups have too), the
    best measured at equal tokens (docs/results.md; the agent path, whose rows carry no turn
    states, sets ``leaf_grpo``)."""

    group_reward_norm: bool = True
    estimator: Literal[ESTIMATORS] = "anchor_state"


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW with global-norm gradient clipping and a warmup + cosine/constant schedule."""

    # tiny policy: 1e-3 (8 tasks a step) rose for ~10 steps, then drifted down (approx KL spikes to
    # 0.1-0.25); 6e-4 with 16 tasks a step and a 5-step warmup rose on every seed (see README)
    lr: float = 6e-4
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0
    # cosine to lr * min_lr_ratio over the run: at a constant lr the default's held-out success peaked
    # at step 10-20 and fell after (seeds 0/1/2: +26.6 / +14.5 / +7.8 at step 30); decayed, every seed's
    # curve rose to the end (+18.4 / +31.2 / +11.7) and greedy success did not fall
    schedule: Literal["constant", "cosine"] = "cosine"
    # optimizer updates (8 per train step by default). 8 was too short: a full-lr update at step 3 drove
    # approx KL to 0.09 and the answer format broke (invalid rate 1.0 at step 4) before recovering
    warmup_steps: int = 40
    min_lr_ratio: float = 0.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """PPO epochs over minibatches, all inside one jitted step."""

    epochs: int = 2
    num_minibatches: int = 4
    eps_clip: float = 0.2
    # DAPO's clip-higher: the ratio's upper clip 1 + 0.28 (lower stays 1 - eps_clip; null: symmetric).
    # On the default run (3 seeds, 30 steps) it gave +26.2 / +25.4 / +11.3 points against +19.9 /
    # +17.6 / +11.7 symmetric, and greedy success did not fall on any seed (it fell on seed 1 without).
    eps_clip_higher: float | None = 0.28
    c_clip: float | None = None
    agg: Literal[LOSS_AGGREGATIONS] = "token-mean"
    # entropy bonus: the objective is loss - entropy_coef * (token-mean next-token entropy); the
    # train rows' ``entropy`` is that mean whatever the coefficient
    entropy_coef: float = 0.0
    # decoupled PPO (AReaL): the learner recomputes the proximal log-probs with its weights at the
    # start of each step; the ratio is taken against them and each token's loss is weighted by the
    # behaviour importance weight exp(proximal - sampled) capped at behave_cap (behave_mode:
    # truncate | mask | mask_sequence; mask_sequence needs rollout.export: flat). One more forward
    # a step; it corrects sampler/learner mismatch, and stale samples once rollouts run ahead.
    # PPO's early stop: within a step, a minibatch whose approx KL (k3, before its update) exceeds
    # 1.5 * target_kl is skipped with every later one (null: off)
    target_kl: float | None = None
    decoupled: bool = False
    behave_cap: float | None = 2.0
    behave_mode: Literal[BEHAVIOUR_WEIGHT_MODES] = "truncate"
    max_rows: int | None = None  # fixed row capacity; default tasks_per_step * group budget
    microbatch_rows: int | None = 8  # gradient accumulation chunk (activation memory bound)
    # activation checkpointing of the learner's forward: none | block (each decoder layer recomputed
    # in the backward pass) | full (the whole forward recomputed); same gradients, less memory
    remat: Literal["none", "block", "full"] = "none"
    len_buckets: list[int] = dataclasses.field(default_factory=lambda: [512, 640, 768, 1024, 2048, 4096])
    # rollout.export=tree_packed: packed row lengths (trees are packed first-fit into rows of the
    # smallest that holds the largest tree). Coarse on purpose: every new (rows, length) shape is a
    # learner program to compile, ~8 s each on 2 CPU cores.
    packed_len_buckets: list[int] = dataclasses.field(default_factory=lambda: [2048, 4096, 8192])


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartConfig:
    """Supervised warm start on noisy generated demonstrations (cached by config hash)."""

    enabled: bool = True
    num_demos: int = 1024
    optimal_prob: float = 0.8  # probability of taking a BFS-optimal action at each turn
    # True: the random moves are imitated too, so the policy samples a noisy version of a good mode
    # (held-out sampled success 0.32, greedy 0.45 after 200 steps; seeds 0/1/2 after 300: 0.36/0.31/0.33,
    # greedy 0.59/0.58/0.44) and RL has noise to remove.
    # False: the random moves shape the episodes (detours, holes) but only optimal moves are in the
    # loss (sampled 0.48, greedy 0.67; GRPO then gained at most ~6 points in 20 steps).
    imitate_noise: bool = True
    # 300 (was 200): some inits (seed 2) had not learned to read the map by step 200 (greedy 0.375 vs
    # 0.438 at 300) and RL then gained only +9 points on them; a fresh 2-core machine's warm start
    # took 178 s instead of 158 s
    steps: int = 300
    batch_size: int = 16
    # None: every SFT batch has batch_size rows. A number: a batch of demos padded to length T has
    # min(batch_size, max(1, max_batch_tokens // T)) rows, and lengths are bucketed by 256, so long
    # demonstrations (a tool agent's, ~1,300 tokens with the tools preamble) cost about what short
    # ones do per step instead of batch_size x T^2 attention
    max_batch_tokens: int | None = None
    lr: float = 3e-3
    cache_dir: str = "~/.cache/jaxprm/warmstart"
    seed: int = 1234


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation: every ``every_steps`` steps (and at the last), or, with the run's
    ``token_budget``, when the train rollouts' sampled tokens first reach each of
    ``token_fractions`` of it (e.g. ``[0.1667, 0.3333, 0.5, 0.6667, 0.8333, 1.0]``: arms compared
    at equal cost)."""

    every_steps: int = 10
    token_fractions: list[float] | None = None
    num_tasks: int = 64
    samples: int = 4
    greedy: bool = True
    at_start: bool = True
    temperature: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every_steps: int = 5
    keep: int = 3
    async_save: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileCacheConfig:
    """JAX's persistent compilation cache: programs compiled by one run are loaded by the next on
    the same machine (and JAX version) instead of being compiled again. ``enabled: false`` turns it
    off; ``dir`` is where the compiled programs are kept; ``precompile`` compiles likely learner
    shapes into it in the background."""

    enabled: bool = True
    dir: str = "~/.cache/jaxprm/xla"
    # with the cache on: compile the packed learner's neighbouring shape buckets (one row bucket and
    # one length bucket either side of each shape a step meets) in a low-priority background thread,
    # so a later step, or the next run, loads them instead of compiling (~4 s each on 2 cores)
    precompile: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device mesh for the train step: ``data`` x ``fsdp`` (-1 on one axis = all remaining)."""

    data: int = -1
    fsdp: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Multi-host (``jaxprm.train.multihost``): with ``enabled``, ``jax.distributed.initialize`` is
    called with these keys (JAX's names), or with none of them set, with what a cluster launcher
    (SLURM, Open MPI, a TPU pod, Kubernetes) puts in the environment. Every process runs the same
    command: each rolls out its share of the step's tasks on its own generation server, the global
    batch spans the ``mesh`` over all processes' devices, process 0 writes the run directory."""

    enabled: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    prm: PRMSection = dataclasses.field(default_factory=PRMSection)
    advantage: AdvantageSection = dataclasses.field(default_factory=AdvantageSection)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    compile_cache: CompileCacheConfig = dataclasses.field(default_factory=CompileCacheConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    steps: int = 30
    # stop after the step at which the train rollouts' sampled (generated) tokens reach this many;
    # ``steps`` is then a cap (null: run ``steps`` steps)
    token_budget: int | None = None
    seed: int = 0
    run_dir: str = "runs/default"
    log_every: int = 1
    progress: bool = True
    plots: bool = True
    export_final: bool = True
