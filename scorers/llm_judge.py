"""``LLMJudgeScorer``: an OpenAI-compatible model rates a partial agent trajectory, blended with a
rule-based heuristic.

Score of a turn::

    s = lam * judge + (1 - lam) * heuristic          (lam = judge_weight, default 0.7)

``judge`` in [0, 1] comes from ``POST {base_url}/v1/chat/completions``; the model must answer with
a JSON object ``{"score": x}`` (code fences and text around the object are tolerated). Transport
errors, timeouts, 429/5xx and malformed answers (not JSON, no numeric ``score``, or outside
[0, 1]) are retried up to ``max_retries`` times, then the turn is rejected. With
``judge_weight == 0`` no request is made.

The prompt is chosen from the *phase* of the recent steps (the last ``phase_window`` steps):
``verification`` if they run tests or show test results, else ``editing`` if they modify files,
else ``diagnosis`` if they search, read files or show tracebacks, else ``default``.

``heuristic`` starts at 0.5 and is clipped to [0, 1] (all counts over the last ``recent_steps``):

    - 0.1 per repeat of an identical action (at most -0.3)
    - 0.1 per failed command: "command not found", "No such file", "SyntaxError", a non-zero exit
      code, ... (at most -0.3)
    - 0.25 premature finish: the last action finishes/submits, yet no test ran after the last edit
      (or nothing was edited at all)
    - 0.2 an edit with no search, file read or test anywhere before it
    + 0.1 edits made after such evidence
    + 0.15 a targeted test run (a test file, ``::node``, ``-k`` selection or a single test module)
    + 0.1 a passing test result
    + 0.05 an informative traceback observed
    + 0.05 code or files discovered while exploring (definitions or paths in an observation)

Observations per turn: ``judge_score``, ``heuristic_score`` (float; mean) and ``phase_<name>``
(boolean; rate) for the four phases.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rollout.types import Interaction
from scorers._http import HTTPScorer
from scorers._trajectory import Step, split_steps, turn_conversation
from scorers.base import PRMMetricObservation, PRMScorerResult

__all__ = ["LLMJudgeScorer", "PHASES", "detect_phase", "heuristic_score", "parse_judge_score"]

PHASES = ("diagnosis", "editing", "verification", "default")

SYSTEM_PROMPT = (
    "You review unfinished runs of a software-engineering agent. A search procedure uses your rating to "
    "decide which runs deserve more attempts. Rate how likely it is that continuing from the current "
    'state ends in a correct fix. Answer with a JSON object and nothing else: {"score": <number from 0 to 1>}.'
)

_PHASE_GUIDANCE = {
    "default": (
        "The agent is somewhere in the middle of solving the issue.",
        [
            "Does each step move the agent measurably closer to a fix?",
            "Are its decisions based on what the code and the command outputs actually show?",
            "Is it free of loops and commands that yield nothing new?",
            "Judging from here, how promising is this run?",
        ],
        "0 means stuck, looping or heading the wrong way; 0.5 means relevant work with unclear progress; "
        "1 means clearly on track.",
    ),
    "diagnosis": (
        "The agent is still exploring the repository to find the cause of the issue.",
        [
            "Is it looking at the files and modules the issue points to?",
            "Does every step narrow down where the bug lives?",
            "Is it collecting evidence (reading code, reproducing the failure) instead of guessing?",
            "Does it avoid searching again for what it already found?",
        ],
        "0 means aimless or repetitive browsing in unrelated places; 0.5 means relevant but slow exploration; "
        "1 means it is closing in on the root cause efficiently.",
    ),
    "editing": (
        "The agent is changing code.",
        [
            "Is it editing the place that the collected evidence identified?",
            "Is the change small and aimed at the diagnosed cause?",
            "Was enough evidence gathered before editing, or is this a guess?",
            "Could the change break other behaviour?",
        ],
        "0 means blind or speculative edits in the wrong place; 0.5 means a plausible edit whose link to the cause "
        "is unclear; 1 means a precise fix grounded in evidence.",
    ),
    "verification": (
        "The agent is running tests or otherwise checking its change.",
        [
            "Are the tests it runs related to the issue rather than arbitrary suites?",
            "When tests fail, does it show that it understands why?",
            "When tests pass, do they exercise the bug that was fixed?",
            "Is it checking the fix rather than claiming success too early?",
        ],
        "0 means unrelated tests, ignored failures or a false claim of success; 0.5 means some testing with unclear "
        "coverage of the fix; 1 means targeted checks that confirm the fix.",
    ),
}


def build_judge_prompt(phase: str, task: str, trajectory: str) -> str:
    """The user prompt for ``phase`` (one of ``PHASES``)."""
    intro, questions, scale = _PHASE_GUIDANCE[phase]
    lines = [f"Rate this unfinished agent run. {intro}", "", "Points to weigh:"]
    lines += [f"* {q}" for q in questions]
    lines += ["", f"Scale: {scale}", "", "Task:", task or "(no task text)", "", "Run so far:", trajectory, ""]
    lines.append('Reply with exactly one JSON object: {"score": <number from 0 to 1>}')
    return "\n".join(lines)


# -- action / observation classification --------------------------------------------------------

_FINISH = re.compile(r"\b(submit|finish|task_done|attempt_completion)\b", re.I)
_TEST = re.compile(r"\b(pytest|py\.test|unittest|nosetests|tox|run_tests?|manage\.py test)\b|\btests?/\S+\.py\b", re.I)
_EDIT = re.compile(
    r"\b(str_replace|str_replace_editor\s+(create|str_replace|insert)|apply_patch|git apply|patch\b|insert|"
    r"create_file|write_file|edit_file|sed -i|replace_in_file)\b|>\s*\S+\.\w+",
    re.I,
)
_SEARCH = re.compile(r"\b(grep|rg|ag|ack|find|search|search_dir|search_file|find_file|git grep)\b", re.I)
_INSPECT = re.compile(r"\b(cat|view|open|head|tail|less|ls|nl|sed -n|goto|scroll_up|scroll_down|tree)\b", re.I)
_TARGETED = re.compile(r"(::\w+|\s-k\s+\S+|\btests?/\S+\.py\b|\btest_\w+\.py\b|unittest\s+\S+\.\S+)", re.I)
_PASSED = re.compile(r"\b(\d+ passed|passed\b|\bOK\b|all tests pass)", re.I)
_FAILED_TESTS = re.compile(r"\b(\d+ failed|FAILED|AssertionError|\d+ errors?)\b")
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
_CMD_FAIL = re.compile(
    r"(command not found|No such file or directory|SyntaxError|IndentationError|ModuleNotFoundError|"
    r"exit(ed)? (code|status) [1-9]\d*|returned non-zero exit status|Permission denied|Usage: )",
    re.I,
)
_DISCOVERY = re.compile(r"(^|\n)\s*(def|class)\s+\w+|\w+/\w+\.\w{1,4}\b")


def classify_action(action: str) -> str:
    """``finish``, ``test``, ``edit``, ``search``, ``inspect`` or ``other`` (first match wins)."""
    if _FINISH.search(action):
        return "finish"
    if _TEST.search(action):
        return "test"
    if _EDIT.search(action):
        return "edit"
    if _SEARCH.search(action):
        return "search"
    if _INSPECT.search(action):
        return "inspect"
    return "other"


def detect_phase(steps: Sequence[Step], *, window: int = 3) -> str:
    """The prompt phase from the last ``window`` steps (see the module docstring)."""
    recent = list(steps)[-window:] if window > 0 else []
    kinds = [classify_action(s.action) for s in recent]
    obs = "\n".join(s.observation for s in recent)
    if "test" in kinds or _PASSED.search(obs) and re.search(r"\btest", obs, re.I) or _FAILED_TESTS.search(obs):
        return "verification"
    if "edit" in kinds:
        return "editing"
    if "search" in kinds or "inspect" in kinds or _TRACEBACK.search(obs):
        return "diagnosis"
    return "default"


def heuristic_score(steps: Sequence[Step], *, recent_steps: int = 8) -> float:
    """The rule-based score of the module docstring, in [0, 1]."""
    all_steps = list(steps)
    recent = all_steps[-recent_steps:] if recent_steps > 0 else []
    kinds_all = [classify_action(s.action) for s in all_steps]
    offset = len(all_steps) - len(recent)
    score = 0.5
    # repeated identical actions
    seen: set[str] = set()
    repeats = 0
    for s in recent:
        key = " ".join(s.action.split())
        if key and key in seen:
            repeats += 1
        seen.add(key)
    score -= min(0.1 * repeats, 0.3)
    # failed commands
    failures = sum(1 for s in recent if _CMD_FAIL.search(s.observation))
    score -= min(0.1 * failures, 0.3)
    # edits with / without earlier evidence (over the whole run)
    evidence = False
    blind_edit = grounded_edit = False
    for kind in kinds_all:
        if kind == "edit":
            if evidence:
                grounded_edit = True
            else:
                blind_edit = True
        elif kind in ("search", "inspect", "test"):
            evidence = True
    if blind_edit:
        score -= 0.2
    if grounded_edit:
        score += 0.1
    # premature finish: finishing without a test after the last edit
    if kinds_all and kinds_all[-1] == "finish":
        last_edit = max((i for i, k in enumerate(kinds_all) if k == "edit"), default=-1)
        tested_after = any(k == "test" for k in kinds_all[last_edit + 1 : -1])
        if last_edit < 0 or not tested_after:
            score -= 0.25
    # useful signals in the recent window
    recent_kinds = kinds_all[offset:]
    if any(k == "test" and _TARGETED.search(s.action) for k, s in zip(recent_kinds, recent)):
        score += 0.15
    if any(k == "test" and _PASSED.search(s.observation) and not _FAILED_TESTS.search(s.observation) for k, s in zip(recent_kinds, recent)):
        score += 0.1
    if any(_TRACEBACK.search(s.observation) for s in recent):
        score += 0.05
    if any(k in ("search", "inspect") and _DISCOVERY.search(s.observation) for k, s in zip(recent_kinds, recent)):
        score += 0.05
    return min(max(score, 0.0), 1.0)


def _clip_text(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[-tail:]}"


def render_trajectory(steps: Sequence[Step], *, first_index: int, max_chars: int) -> str:
    """Compact text of the given steps: tool type, action, observation and extracted signals."""
    lines = []
    for k, s in enumerate(steps, start=first_index):
        kind = classify_action(s.action)
        signals = []
        if _CMD_FAIL.search(s.observation):
            signals.append("command failed")
        if _TRACEBACK.search(s.observation):
            signals.append("traceback")
        if _FAILED_TESTS.search(s.observation):
            signals.append("tests failing")
        elif kind == "test" and _PASSED.search(s.observation):
            signals.append("tests passing")
        lines.append(f"[step {k}] ({kind})")
        lines.append(f"action: {_clip_text(s.action.strip(), max_chars)}")
        if s.observation.strip():
            lines.append(f"observation: {_clip_text(s.observation.strip(), max_chars)}")
        if signals:
            lines.append(f"signals: {', '.join(signals)}")
    return "\n".join(lines) if lines else "(no steps yet)"




def _json_objects(text: str):
    """Every JSON object embedded in ``text``, outermost first: decoding starts at each ``{`` with a
    real JSON parser, so braces inside strings and nested objects are handled."""
    decoder = json.JSONDecoder()
    pos = text.find("{")
    while pos >= 0:
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            pos = text.find("{", pos + 1)
            continue
        yield obj
        if isinstance(obj, Mapping):  # objects nested in this one are candidates too
            yield from (v for v in _nested_mappings(obj))
        pos = text.find("{", end)


def _nested_mappings(obj: Any):
    for v in obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, list) else ():
        if isinstance(v, Mapping):
            yield v
        if isinstance(v, (Mapping, list)):
            yield from _nested_mappings(v)


def parse_judge_score(content: Any) -> float:
    """The ``score`` in a judge answer. Raises ``ValueError`` when it is missing or malformed."""
    if not isinstance(content, str):
        raise ValueError(f"judge content must be a string, got {type(content).__name__}")
    text = content.strip()
    if text.startswith("```"):
        text = re.sub(r"^```[a-zA-Z]*\s*|\s*```$", "", text)
    for obj in _json_objects(text):
        if isinstance(obj, Mapping) and "score" in obj:
            value = obj["score"]
            if isinstance(value, str):
                value = float(value)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"judge score must be a number, got {value!r}")
            value = float(value)
            if not (math.isfinite(value) and 0.0 <= value <= 1.0):
                raise ValueError(f"judge score must be in [0, 1], got {value}")
            return value
    raise ValueError(f"no JSON object with a 'score' in the judge answer: {content[:200]!r}")


#: Sampling temperature of a retry: a deterministic server at temperature 0 would repeat the same
#: malformed answer on every retry.
RETRY_TEMPERATURE = 0.7


def _retry_payload(payload: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The request of retry ``attempt``: the first is sent as built; a retry samples
    (``temperature >= RETRY_TEMPERATURE``) with a seed per attempt, so it can answer differently."""
    if attempt == 0:
        return payload
    return {**payload, "temperature": max(float(payload.get("temperature", 0.0)), RETRY_TEMPERATURE),
            "seed": attempt}


def _chat_content(data: Any) -> str:
    return data["choices"][0]["message"]["content"]


class LLMJudgeScorer(HTTPScorer):
    """LLM-as-judge process score in [0, 1] (see the module docstring).

    Kwargs: ``base_url`` and ``model`` (required), ``api_key``, ``judge_weight`` (lambda in [0, 1],
    default 0.7), ``recent_steps`` (steps shown and used by the heuristic, default 8),
    ``phase_window`` (default 3), ``max_chars`` (per action/observation, default 1500),
    ``temperature`` (0.0), ``max_tokens`` (64), ``json_mode`` (send ``response_format`` json_object,
    default False), ``timeout_s`` (30), ``max_retries`` (2), ``backoff_s`` (0.5),
    ``max_concurrency`` (16), ``breaker_failures`` (5), ``breaker_probe_s`` (5) (the HTTP options:
    ``scorers._http.HTTPOptions``; the circuit breaker: ``scorers.breaker``).
    """

    name = "llm_judge"

    @classmethod
    def reward_range(cls, **kwargs: Any) -> tuple[float, float]:
        return (0.0, 1.0)  # a blend of a judge score and a heuristic, both in [0, 1]

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        judge_weight: float = 0.7,
        recent_steps: int = 8,
        phase_window: int = 3,
        max_chars: int = 1500,
        temperature: float = 0.0,
        max_tokens: int = 64,
        json_mode: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError(f"model must be a non-empty string, got {model!r}")
        if isinstance(judge_weight, bool) or not isinstance(judge_weight, (int, float)) or not 0 <= judge_weight <= 1:
            raise ValueError(f"judge_weight must be in [0, 1], got {judge_weight!r}")
        for key, v in (("recent_steps", recent_steps), ("phase_window", phase_window), ("max_chars", max_chars), ("max_tokens", max_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be an int >= 1, got {v!r}")
        super().__init__(base_url, **kwargs)
        self.model = model
        self.judge_weight = float(judge_weight)
        self.recent_steps = recent_steps
        self.phase_window = phase_window
        self.max_chars = max_chars
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        self.json_mode = bool(json_mode)

    def build_request(self, interaction: Interaction, ctx: Mapping[str, Any] | None) -> tuple[str, dict[str, Any], list[Step]]:
        """``(phase, chat-completions payload, steps)`` for this turn (no I/O)."""
        task, steps = split_steps(turn_conversation(interaction, ctx))
        recent = steps[-self.recent_steps :]
        phase = detect_phase(steps, window=self.phase_window)
        trajectory = render_trajectory(recent, first_index=len(steps) - len(recent) + 1, max_chars=self.max_chars)
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": build_judge_prompt(phase, _clip_text(task, 4 * self.max_chars), trajectory)},
            ],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        if self.json_mode:
            payload["response_format"] = {"type": "json_object"}
        return phase, payload, steps

    async def _components(self, interaction: Interaction, ctx: Mapping[str, Any]) -> tuple[float, float, float, str]:
        phase, payload, steps = self.build_request(interaction, ctx)
        heur = heuristic_score(steps, recent_steps=self.recent_steps)
        if self.judge_weight > 0:
            judge = await self.http.post_json(
                "/v1/chat/completions", lambda attempt: _retry_payload(payload, attempt),
                lambda data: parse_judge_score(_chat_content(data)),
            )
        else:
            judge = 0.0
        blended = self.judge_weight * judge + (1.0 - self.judge_weight) * heur
        return blended, judge, heur, phase

    async def evaluate(self, interaction: Interaction, ctx: Mapping[str, Any]) -> float:
        return (await self._components(interaction, ctx))[0]

    async def evaluate_result(self, interaction: Interaction, ctx: Mapping[str, Any]) -> PRMScorerResult:
        blended, judge, heur, phase = await self._components(interaction, ctx)
        iid = interaction.id
        obs = [
            PRMMetricObservation("judge_score", "turn", iid, judge, "float", ("mean",)),
            PRMMetricObservation("heuristic_score", "turn", iid, heur, "float", ("mean",)),
        ]
        obs += [PRMMetricObservation(f"phase_{p}", "turn", iid, p == phase, "boolean", ("rate",)) for p in PHASES]
        return PRMScorerResult(reward=blended, observations=tuple(obs))
