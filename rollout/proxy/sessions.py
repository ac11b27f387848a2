"""Sessions and their records: keys, the parent rule, rewards, ready trajectories, claims, sweeps.

A *session* is one agent episode, identified by its bearer key. Every chat call of a session makes
one :class:`Record`. A record's **parent** is, among the session's *completed* records, the one with
the most messages whose ``messages + [output]`` is a prefix of the new request's messages (message
dicts compared for equality after dropping keys whose value is null, because the OpenAI SDK's
``message.model_dump()`` writes every optional field as null; ties go to the earliest record;
in-flight records are skipped). So a session is a tree: a retry or a fork makes siblings.

**Sampling seeds.** A session started with a ``seed`` (a jaxprm extension of ``start_session``)
samples every request that brings no ``seed`` of its own with
``rollout.groups.request_seed(seed, f"b{i}", depth[, k])``: ``i`` is the session's index in its group,
``depth`` the record's number of ancestors and ``k`` (left out when 0) how many earlier records share
its parent (a retry samples anew). These are the seeds of a flat tree group whose group seed parts
are ``seed`` (``f"{config seed}:{group seed}"``), so against a deterministic server an agent's
linear chats sample exactly what the tree path's branches sample; and a seeded run's rollouts are
reproducible. Without a ``seed`` the server draws one per request.

``set_reward`` moves the session's completed, not yet trajectory-bound records into a **ready
trajectory** (numbered 0, 1, ... per session). ``claim`` takes ready trajectories out of the
session for an export; it is synchronous, so it runs under the event loop's atomicity (no await
between reading and taking: a retried export of a consumed trajectory finds nothing). Consumed
records stay in a session that is not removed (``__hitl__``, ``remove_session: false``) so that
later turns still find their parent and stay token-identical; they are never exported again.

All state lives on the event loop thread and is changed only in synchronous sections: concurrent
sessions share nothing but the store's dictionaries.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rollout.proxy.config import HITL_SESSION, ProxyError
from rollout.groups import request_seed
from rollout.responses_api import ResponseStore
from rollout.types import ModelResponse, copy_json

__all__ = ["Record", "Session", "SessionStore", "normalize_message", "HITL_SESSION"]


def normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message as the parent rule compares it: top-level keys whose value is null dropped; an
    assistant message's ``tool_calls`` reduced to ``id`` / ``type`` / ``function.name`` /
    ``function.arguments`` (SDKs echo calls with extra null or default fields), and its empty
    ``content`` dropped when it has calls (``""`` and null mean the same there)."""
    out = {k: v for k, v in message.items() if v is not None}
    calls = out.get("tool_calls")
    if out.get("role") == "assistant" and isinstance(calls, list) and calls:
        out["tool_calls"] = [_call_key(c) for c in calls]
        if out.get("content") == "":
            del out["content"]
    return out


def _call_key(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    fn = call["function"]
    return {"id": call.get("id"), "type": call.get("type") or "function",
            "function": {"name": fn.get("name"), "arguments": fn.get("arguments")}}


@dataclasses.dataclass(eq=False)
class Record:
    """One chat call of a session.

    Attributes:
      id: the interaction id, also the ``id`` of the OpenAI answer (``chatcmpl-...``).
      seq: creation order within the session.
      messages: a deep copy of the request's messages.
      norm: the normalized messages (see :func:`normalize_message`), for the parent rule.
      parent: the parent record (``None``: a root).
      concat: the prompt was built by concatenation (``False``: a fresh template rendering).
      response: the token-backed upstream answer (``None`` while in flight): the prompt sent
        (``input_tokens``), the sampled tokens, their log-probs, the stop reason.
      output_message: the assistant message returned to the agent (``content``, and ``tool_calls``
        parsed out of the generated text).
      raw_text: the generated text as sampled (tool-call markup included; the concat rule renders it).
      tools: the request's function tools (``None``: none), rendered into its prompts.
      version: the weight version of the output tokens (``-1``: not reported by the upstream).
      reward / env_state: set by ``set_reward`` (``env_states`` is a jaxprm extension).
      trajectory: the ready trajectory this record belongs to (``None``: not yet rewarded).
      depth: the number of ancestors (0 for a root).
      sibling: how many earlier records of the session share this record's parent.
      out_norm: the normalized output message (set on completion).
    """

    id: str
    seq: int
    messages: list[dict[str, Any]]
    norm: list[dict[str, Any]]
    parent: Record | None
    concat: bool
    depth: int = 0
    sibling: int = 0
    out_norm: dict[str, Any] | None = None
    response: ModelResponse | None = None
    output_message: dict[str, Any] | None = None
    raw_text: str = ""
    tools: tuple[dict[str, Any], ...] | None = None
    version: int = -1
    reward: float | None = None
    env_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    trajectory: int | None = None
    consumed: bool = False
    created: float = dataclasses.field(default_factory=time.time)

    @property
    def done(self) -> bool:
        return self.response is not None

    @property
    def text(self) -> str:
        """The generated text as sampled (tool-call markup included)."""
        return self.raw_text

    def full_norm(self) -> list[dict[str, Any]]:
        assert self.out_norm is not None
        return [*self.norm, self.out_norm]


class Session:
    """One agent episode: its key, records and ready trajectories."""

    def __init__(self, session_id: str, api_key: str, *, task_id: str, group_id: str, seed: int | str | None = None,
                 index: int = 0) -> None:
        self.id = session_id
        self.seed = seed
        self.index = index
        self.api_key = api_key
        self.task_id = task_id
        self.group_id = group_id
        self.records: dict[str, Record] = {}
        self.ready: dict[int, list[Record]] = {}
        self.ended = False
        self.removed = False
        self.inflight = 0
        self._next_trajectory = 0
        self._last_trajectory: int | None = None
        self._seq = 0
        self._by_length: dict[int, list[Record]] = {}  # completed records by len(messages) + 1
        self._longest = 0
        self.last_active = time.monotonic()
        self.responses = ResponseStore()  # the session's Responses-API conversations (previous_response_id)

    @property
    def is_hitl(self) -> bool:
        return self.id == HITL_SESSION

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def check_open(self) -> None:
        if self.ended:
            raise ProxyError(410, f"session {self.id!r} has ended (end_session was called); start a new session")
        if self.removed:
            raise ProxyError(410, f"session {self.id!r} was removed (exported or swept); start a new session")

    # ------------------------------------------------------------------ records

    def find_parent(self, norm: Sequence[Mapping[str, Any]]) -> Record | None:
        """The longest completed record whose conversation (messages + output) prefixes ``norm``
        (ties: the earliest). Completed records are indexed by conversation length, so the search
        tries the longest lengths first and compares a candidate's last message before the rest:
        about one full comparison per turn for a linear chat, however long the session."""
        by_len = self._by_length
        for k in range(min(len(norm), self._longest), 0, -1):
            found = [rec for rec in by_len.get(k, ()) if rec.out_norm == norm[k - 1] and rec.norm == list(norm[:k - 1])]
            if found:
                return min(found, key=lambda r: r.seq)
        return None

    def begin(self, messages: list[dict[str, Any]], *, concat: bool, owned: bool = False,
              tools: Sequence[dict[str, Any]] | None = None) -> Record:
        """Create an in-flight record for a chat request (parent resolved now). The messages are
        deep-copied unless ``owned`` (the caller hands over objects nobody else refers to, e.g.
        just parsed from a request body)."""
        self.check_open()
        msgs = messages if owned else copy_json(messages)
        norm = [normalize_message(m) for m in msgs]
        parent = self.find_parent(norm)
        depth = 0 if parent is None else parent.depth + 1
        sibling = sum(1 for r in self.records.values() if r.parent is parent and r.depth == depth)
        rec = Record(id=f"chatcmpl-{secrets.token_hex(12)}", seq=self._seq, messages=msgs, norm=norm,
                     parent=parent, concat=concat, depth=depth, sibling=sibling,
                     tools=tuple(tools) if tools else None)
        self._seq += 1
        self.records[rec.id] = rec
        self.inflight += 1
        self.touch()
        return rec

    def sampling_seed(self, rec: Record) -> int | None:
        """The seed for ``rec`` when its request gives none (see the module docstring)."""
        if self.seed is None:
            return None
        parts = (self.seed, f"b{self.index}", rec.depth) + ((rec.sibling,) if rec.sibling else ())
        return request_seed(*parts)

    def complete(self, rec: Record, response: ModelResponse, text: str,
                 message: dict[str, Any] | None = None) -> None:
        """Record the upstream's answer: ``text`` as generated, ``message`` what the agent gets
        (default: ``{"role": "assistant", "content": text}``)."""
        rec.response = response
        rec.raw_text = text
        rec.output_message = message if message is not None else {"role": "assistant", "content": text}
        rec.out_norm = normalize_message(rec.output_message)
        rec.version = -1 if response.weight_version is None else int(response.weight_version)
        k = len(rec.norm) + 1
        self._by_length.setdefault(k, []).append(rec)
        self._longest = max(self._longest, k)
        self.inflight -= 1
        self.touch()

    def abort(self, rec: Record) -> None:
        """Forget a record whose upstream call failed or was cancelled (it can never be a parent)."""
        if self.records.pop(rec.id, None) is not None:
            self.inflight -= 1
        self.touch()

    def last_record(self) -> Record | None:
        """The most recent completed record that is not consumed."""
        for rec in reversed(self.records.values()):
            if rec.done and not rec.consumed:
                return rec
        return None

    # ------------------------------------------------------------------ rewards

    def set_reward(self, *, interaction_id: str | None = None, reward: Any = None,
                   rewards: Mapping[str, Any] | None = None,
                   env_states: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Apply rewards, then move completed unbound records into a new ready trajectory.

        Validation happens before any change (an unknown id is a 400 and changes nothing).
        Returns ``{interaction_count, session_id, trajectory_id, trajectory_ready, ready_transition}``.
        """
        self.check_open()
        if reward is None and not rewards and not env_states:
            raise ProxyError(400, "set_reward needs 'reward' (a number) or 'rewards' ({interaction_id: number})",
                             param="reward")
        updates: dict[str, float] = {}
        if reward is not None:
            value = _finite("reward", reward)
            if interaction_id is None:
                last = self.last_record()
                if last is None:
                    raise ProxyError(400, f"session {self.id!r} has no completed interaction to reward",
                                     param="interaction_id")
                updates[last.id] = value
            else:
                updates[self._known(interaction_id, "interaction_id").id] = value
        elif interaction_id is not None:
            self._known(interaction_id, "interaction_id")
        if rewards is not None:
            if not isinstance(rewards, Mapping):
                raise ProxyError(400, "'rewards' must be an object {interaction_id: number}", param="rewards")
            for iid, v in rewards.items():
                updates[self._known(iid, "rewards").id] = _finite(f"rewards[{iid!r}]", v)
        states: dict[str, dict[str, Any]] = {}
        if env_states is not None:
            if not isinstance(env_states, Mapping):
                raise ProxyError(400, "'env_states' must be an object {interaction_id: object}", param="env_states")
            for iid, st in env_states.items():
                if not isinstance(st, Mapping):
                    raise ProxyError(400, f"env_states[{iid!r}] must be an object", param="env_states")
                states[self._known(iid, "env_states").id] = copy_json(dict(st))
        for iid, v in updates.items():
            self.records[iid].reward = v
        for iid, st in states.items():
            self.records[iid].env_state = st
        pending = [r for r in self.records.values() if r.done and r.trajectory is None]
        transition = bool(pending)
        if transition:
            tid = self._next_trajectory
            self._next_trajectory += 1
            for r in pending:
                r.trajectory = tid
            self.ready[tid] = pending
            self._last_trajectory = tid
        tid = self._last_trajectory
        self.touch()
        return {
            "interaction_count": len(self.ready.get(tid, [])) if tid is not None else 0,
            "session_id": self.id,
            "trajectory_id": tid,
            "trajectory_ready": tid is not None and tid in self.ready,
            "ready_transition": transition,
        }

    def _known(self, iid: Any, param: str) -> Record:
        rec = self.records.get(iid) if isinstance(iid, str) else None
        if rec is None or not rec.done:
            raise ProxyError(400, f"unknown interaction id {iid!r} in session {self.id!r}", param=param)
        if rec.consumed:
            raise ProxyError(400, f"interaction {iid!r} was already exported; its reward can no longer change",
                             param=param)
        return rec

    def end(self) -> dict[str, Any]:
        """v1 ``end_session``: bind what is pending into a ready trajectory, then refuse new calls."""
        self.check_open()
        pending = [r for r in self.records.values() if r.done and r.trajectory is None]
        if pending:
            tid = self._next_trajectory
            self._next_trajectory += 1
            for r in pending:
                r.trajectory = tid
            self.ready[tid] = pending
            self._last_trajectory = tid
        self.ended = True
        self.touch()
        return {"session_id": self.id, "trajectory_id": self._last_trajectory, "ended": True}

    # ------------------------------------------------------------------ export

    def claim(self, trajectory_id: int | None = None) -> list[tuple[int, list[Record]]]:
        """Take ready trajectories out (all of them, or only ``trajectory_id``); synchronous."""
        if trajectory_id is None:
            ids = sorted(self.ready)
        else:
            ids = [trajectory_id] if trajectory_id in self.ready else []
        out = []
        for tid in ids:
            recs = self.ready.pop(tid)
            for r in recs:
                r.consumed = True
            out.append((tid, recs))
        self.touch()
        return out

    def selected(self, trajectory_id: int | None = None) -> list[Record]:
        """The records an export would claim (for validation before claiming)."""
        if trajectory_id is None:
            return [r for recs in self.ready.values() for r in recs]
        return list(self.ready.get(trajectory_id, []))


def _finite(name: str, value: Any) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ProxyError(400, f"{name} must be a finite number, got {value!r}", param=name.split("[")[0])
    return float(value)


class SessionStore:
    """All live sessions, by id and by key; groups; the ``__hitl__`` session; the stale sweep."""

    def __init__(self, admin_key: str, *, max_group_size: int = 1024,
                 on_remove: Callable[[Session], None] | None = None) -> None:
        self.admin_key = admin_key
        self.max_group_size = max_group_size
        self.on_remove = on_remove
        self.by_id: dict[str, Session] = {}
        self.by_key: dict[str, Session] = {}
        self.hitl = Session(HITL_SESSION, admin_key, task_id=HITL_SESSION, group_id=HITL_SESSION)
        self.by_id[HITL_SESSION] = self.hitl
        self.counters = {"sessions_started": 0, "sessions_removed": 0, "sessions_swept": 0}

    def start_group(self, task_id: Any, group_size: Any = 1, *, api_key: Any = None, group_id: Any = None,
                    seed: Any = None) -> tuple[str, list[Session]]:
        """Start ``group_size`` sessions ``"{task_id}-{i}"``; returns ``(group_id, sessions)``.
        ``seed`` (an int or a string): the sessions' sampling seeds (see the module docstring).

        400: a bad task id / group size / key, or the admin key as a session key; 409: a session id
        or group id in use, or a requested key bound to an unfinished session.
        """
        if not isinstance(task_id, str) or not task_id.strip():
            raise ProxyError(400, f"task_id must be a non-empty string, got {task_id!r}", param="task_id")
        if task_id == HITL_SESSION:
            raise ProxyError(400, f"task_id {HITL_SESSION!r} is reserved", param="task_id")
        if isinstance(group_size, bool) or not isinstance(group_size, int) or not 1 <= group_size <= self.max_group_size:
            raise ProxyError(400, f"group_size must be an integer in [1, {self.max_group_size}], got {group_size!r}",
                             param="group_size")
        gid = task_id if group_id is None else group_id
        if not isinstance(gid, str) or not gid.strip():
            raise ProxyError(400, f"group_id must be a non-empty string, got {group_id!r}", param="group_id")
        if api_key is not None:
            if not isinstance(api_key, str) or not api_key.strip():
                raise ProxyError(400, "api_key must be a non-empty string", param="api_key")
            if group_size != 1:
                raise ProxyError(400, "api_key can only be given with group_size 1 (one key per session)",
                                 param="api_key")
            if secrets.compare_digest(api_key.encode(), self.admin_key.encode()):
                raise ProxyError(400, "api_key must not be the admin key", param="api_key")
            bound = self.by_key.get(api_key)
            if bound is not None and not bound.ended:
                raise ProxyError(409, f"api_key is bound to the unfinished session {bound.id!r}", param="api_key")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, str)) or seed == ""):
            raise ProxyError(400, f"seed must be an integer or a non-empty string, got {seed!r}", param="seed")
        ids = [f"{task_id}-{i}" for i in range(group_size)]
        taken = [s for s in ids if s in self.by_id]
        if taken:
            raise ProxyError(409, f"session id {taken[0]!r} is in use (export it with remove_session or wait "
                                  f"for the sweep); give another task_id", param="task_id")
        if any(s.group_id == gid for s in self.by_id.values()):
            raise ProxyError(409, f"group_id {gid!r} is in use", param="group_id")
        if api_key is not None and api_key in self.by_key:
            self.remove(self.by_key[api_key])  # an ended session's key is being reused
        sessions = []
        for i, sid in enumerate(ids):
            key = api_key if api_key is not None else f"sk-sess-{secrets.token_urlsafe(24)}"
            s = Session(sid, key, task_id=task_id, group_id=gid, seed=seed, index=i)
            self.by_id[sid] = s
            self.by_key[key] = s
            sessions.append(s)
        self.counters["sessions_started"] += len(sessions)
        return gid, sessions

    def session_for_key(self, key: str | None) -> Session | None:
        """The session a bearer key names: the admin key names ``__hitl__``; unknown -> ``None``."""
        if not key:
            return None
        if secrets.compare_digest(key.encode(), self.admin_key.encode()):
            return self.hitl
        return self.by_key.get(key)

    def is_admin(self, key: str | None) -> bool:
        return bool(key) and secrets.compare_digest(key.encode(), self.admin_key.encode())

    def remove(self, session: Session) -> bool:
        """Remove ``session`` (by identity: a newer session that reuses the id is untouched).
        ``__hitl__`` is never removed. Returns whether it was removed now."""
        if session.is_hitl or session.removed:
            return False
        if self.by_id.get(session.id) is session:
            del self.by_id[session.id]
        if self.by_key.get(session.api_key) is session:
            del self.by_key[session.api_key]
        session.removed = True
        self.counters["sessions_removed"] += 1
        if self.on_remove is not None:
            self.on_remove(session)
        return True

    def sweep(self, timeout_s: float, *, now: float | None = None) -> list[str]:
        """Remove sessions idle for more than ``timeout_s`` (none with a chat in flight)."""
        now = time.monotonic() if now is None else now
        stale = [s for s in self.by_id.values()
                 if not s.is_hitl and s.inflight == 0 and now - s.last_active > timeout_s]
        for s in stale:
            self.remove(s)
        self.counters["sessions_swept"] += len(stale)
        return [s.id for s in stale]

    def __len__(self) -> int:
        return len(self.by_id) - 1
