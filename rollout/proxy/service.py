"""``RecordingProxy``: the proxy's behaviour as a Python object (the HTTP app is a thin layer on it).

A caller in the same process (the trainer) uses it directly and gets rows without serialization:

    proxy = RecordingProxy(config, tokenizer)
    await proxy.startup()                                    # upstream client, then the PRMRunner
    gid, sessions = proxy.start_session("task-7", group_size=8)
    ...  agents chat at the proxy's HTTP base URL with their session keys ...
    proxy.set_reward(session, {"reward": 1.0})
    result = await proxy.export({"session_ids": [...], "group_id": gid})   # ExportResult
    await proxy.shutdown()                                   # drain exports, runner, then client

Export, in order: refuse during shutdown (503); validate the request (400, nothing consumed: bad
fields, duplicate ids, a non-concat style with active scorers, non-concat records in a concat
export); claim the selected ready trajectories of every listed session (synchronous: consume once);
then, unless the request discards, reject the whole group if a session is missing (no session, or
nothing ready), else score all sessions concurrently (branches of a session in order, on clones) and
reject the group if any failed; finally (success, rejection, error or cancellation alike) remove the
listed sessions when ``remove_session`` (never ``__hitl__``; by identity, so a new session that
reuses the id is untouched). ``prm_stats`` carries every successfully scored session, even when
another member rejected the group; it is absent when scoring is off or the export discarded.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rollout.chat import ChatTokenizer
from rollout.client import GenerationClient, GenerationError
from rollout.proxy.chat import ChatRequest, parse_chat_request
from rollout.proxy.config import ProxyConfig, ProxyError
from rollout.proxy.export import PRMStats, ProxyRow, concat_rows, individual_rows, score_sessions, trajectory_tree
from rollout.proxy.sessions import Record, Session, SessionStore
from rollout.proxy.tokenize import PromptMaker
from rollout.responses_api import ResponseStore, conversation, response_object, to_chat_body
from rollout.tool_calls import ParsedOutput, get_parser, template_renders_tools
from scorers.base import BaseScorer
from scorers.runner import PRMRunner

__all__ = ["RecordingProxy", "ExportRequest", "ExportResult", "EXPORT_STYLES"]

logger = logging.getLogger(__name__)

EXPORT_STYLES = ("concat", "individual")


@dataclasses.dataclass(frozen=True)
class ExportRequest:
    """``POST /export_trajectories`` (see docs/design.md, "The recording proxy"); built with :meth:`from_body`."""

    session_ids: tuple[str, ...]
    group_id: str | None = None
    trajectory_id: int | None = None
    discount: float = 1.0
    style: str = "concat"
    remove_session: bool = True
    discard_trajectory: bool = False
    is_eval: bool = False

    _TYPES = {"group_id": str, "trajectory_id": int, "discount": (int, float), "style": str, "remove_session": bool,
              "discard_trajectory": bool, "is_eval": bool}

    @classmethod
    def from_body(cls, body: Any) -> ExportRequest:
        if not isinstance(body, Mapping):
            raise ProxyError(400, "the request body must be a JSON object")
        allowed = {"session_ids", *cls._TYPES}
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise ProxyError(400, f"unknown fields {unknown}; allowed: {sorted(allowed)}", param=unknown[0])
        ids = body.get("session_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(s, str) and s for s in ids):
            raise ProxyError(400, "session_ids must be a non-empty list of session id strings", param="session_ids")
        kw: dict[str, Any] = {}
        for key, tp in cls._TYPES.items():
            if body.get(key) is None:
                continue
            v = body[key]
            if isinstance(v, bool) and tp is not bool or not isinstance(v, tp):
                raise ProxyError(400, f"{key} has the wrong type: {v!r}", param=key)
            kw[key] = v
        return cls(session_ids=tuple(ids), **kw)

    def validate(self, *, scoring: bool) -> None:
        """The checks made before anything is claimed (each a 400)."""
        dup = sorted({s for s in self.session_ids if self.session_ids.count(s) > 1})
        if dup:
            raise ProxyError(400, f"duplicate session ids {dup} in session_ids", param="session_ids")
        if self.style not in EXPORT_STYLES:
            raise ProxyError(400, f"style={self.style!r}; allowed: {list(EXPORT_STYLES)}", param="style")
        if scoring and self.style != "concat":
            raise ProxyError(400, f"style={self.style!r} is not allowed with active process-reward scorers; "
                                  "allowed: 'concat'", param="style")
        if not (math.isfinite(self.discount) and 0.0 <= self.discount <= 1.0):
            raise ProxyError(400, f"discount must be in [0, 1], got {self.discount!r}", param="discount")
        if self.trajectory_id is not None and self.trajectory_id < 0:
            raise ProxyError(400, f"trajectory_id must be >= 0, got {self.trajectory_id}", param="trajectory_id")


@dataclasses.dataclass
class ExportResult:
    """What an export produced. ``rejected``: why the group was rejected (then ``rows`` is empty)."""

    rows: list[ProxyRow]
    prm_stats: PRMStats | None = None
    rejected: dict[str, Any] | None = None
    discarded: bool = False
    records: int = 0
    generated_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": [r.to_json() for r in self.rows]}
        if self.prm_stats is not None:
            out["prm_stats"] = self.prm_stats.to_json()
        if self.rejected is not None:
            out["rejected"] = self.rejected
        if self.discarded:
            out["discarded"] = True
        return out


class RecordingProxy:
    """The recording proxy (see the module docstring).

    Args:
      config: the :class:`ProxyConfig`.
      tokenizer: a ``rollout.chat.ChatTokenizer`` matching the upstream model.
      scorers: scorer instances to *borrow* (tests; the runner never closes them). Scorers are
        otherwise built from ``config.prm`` at startup and owned by the runner.
      client: a generation client to borrow (never closed here); default: one built from
        ``config.upstream`` at startup and closed at shutdown.
    """

    def __init__(self, config: ProxyConfig, tokenizer: ChatTokenizer, *, scorers: Sequence[BaseScorer] | None = None,
                 client: GenerationClient | None = None) -> None:
        if scorers and config.chat_template_type != "concat":
            raise ValueError("process-reward scorers need chat_template_type 'concat'")
        self.config = config
        self.store = SessionStore(config.admin_key, max_group_size=config.max_group_size, on_remove=self._forget)
        self.prompts = PromptMaker(tokenizer)
        self.tokenizer = tokenizer
        self.tool_parser = get_parser(config.tool_call_parser)
        self._borrowed_scorers = list(scorers or [])
        self._borrowed_client = client
        self.client: GenerationClient | None = client
        self.runner: PRMRunner | None = None
        self.started = False
        self.closing = False
        self._exports: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        self.counters = collections.Counter()
        self.overhead_s: collections.deque[float] = collections.deque(maxlen=100_000)
        self._token_text_cache: dict[int, str] = {}
        self._tools_ok: bool | None = None
        self.responses = ResponseStore()  # previous_response_id of unrecorded (passthrough) turns

    def _forget(self, session: Session) -> None:
        """A removed session's sticky upstream route is released (the client's table stays small)."""
        if self.client is not None:
            self.client.release(session.id)

    # ------------------------------------------------------------------ lifecycle

    @property
    def scoring(self) -> bool:
        return self.runner is not None and self.runner.active

    async def startup(self) -> None:
        """Open the upstream client, then build the PRMRunner with the async factory. A startup
        failure closes what was opened (its own failures become notes) and re-raises the original."""
        if self.client is None:
            self.client = GenerationClient(self.config.upstream)
        try:
            if self.config.prm_active or self._borrowed_scorers:
                self.runner = await PRMRunner.create(self.config.prm if self.config.prm_active else None,
                                                     scorers=self._borrowed_scorers or None)
        except BaseException as err:
            if self._borrowed_client is None:
                try:
                    await self.client.aclose()
                except Exception as close_err:
                    err.add_note(f"closing the upstream client after the startup failure also failed: {close_err!r}")
                self.client = None
            raise
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="proxy-session-sweep")
        self.started = True

    def begin_shutdown(self) -> None:
        """From now on exports, session starts and chats get 503."""
        self.closing = True

    async def shutdown(self) -> None:
        """Refuse new work, drain in-flight exports (cancelled after ``drain_timeout_s``), close the
        runner, then the upstream client (even if scorer cleanup failed; that error is re-raised)."""
        self.begin_shutdown()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None
        await self.drain(self.config.drain_timeout_s)
        error: BaseException | None = None
        try:
            if self.runner is not None:
                await self.runner.aclose()
        except Exception as e:
            logger.error("closing the PRM runner failed: %r", e)
            error = e
        finally:
            if self.client is not None and self._borrowed_client is None:
                await self.client.aclose()
            self.client = None if self._borrowed_client is None else self.client
            self.started = False
        if error is not None:
            raise error

    async def drain(self, timeout_s: float) -> None:
        """Wait for in-flight exports; cancel the ones still running after ``timeout_s``."""
        pending = [t for t in self._exports if not t.done()]
        if not pending:
            return
        done, still = await asyncio.wait(pending, timeout=timeout_s)
        for t in still:
            t.cancel()
        if still:
            await asyncio.wait(still)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            swept = self.store.sweep(self.config.session_timeout_s)
            if swept:
                logger.info("swept %d stale session(s): %s", len(swept), swept[:5])

    def _check_open(self, what: str) -> None:
        if self.closing:
            raise ProxyError(503, f"the proxy is shutting down; {what} refused")
        if not self.started:
            raise ProxyError(503, f"the proxy has not started; {what} refused")

    # ------------------------------------------------------------------ sessions

    def start_session(self, task_id: Any, group_size: Any = 1, *, api_key: Any = None, group_id: Any = None,
                      seed: Any = None) -> tuple[str, list[Session]]:
        """``(group_id, sessions)``; see ``SessionStore.start_group`` (``seed``: the sessions'
        sampling seeds) for the errors."""
        self._check_open("start_session")
        return self.store.start_group(task_id, group_size, api_key=api_key, group_id=group_id, seed=seed)

    def set_reward(self, session: Session, body: Any) -> dict[str, Any]:
        """``{interaction_id?, reward?, rewards?, env_states?}`` -> the set_reward answer."""
        if not isinstance(body, Mapping):
            raise ProxyError(400, "the request body must be a JSON object")
        unknown = sorted(set(body) - {"interaction_id", "reward", "rewards", "env_states"})
        if unknown:
            raise ProxyError(400, f"unknown fields {unknown}; allowed: interaction_id, reward, rewards, env_states",
                             param=unknown[0])
        return session.set_reward(interaction_id=body.get("interaction_id"), reward=body.get("reward"),
                                  rewards=body.get("rewards"), env_states=body.get("env_states"))

    # ------------------------------------------------------------------ chat

    def session_for_turn(self, key: str | None) -> Session | None:
        """The session a chat or Responses call with bearer ``key`` records into (``None``: forwarded
        unrecorded, when the proxy passes through); otherwise 401 for no or an unknown key, 410
        for an ended or removed session."""
        session = self.store.session_for_key(key)
        if session is None and not self.config.passthrough:
            raise ProxyError(401, "missing Authorization: Bearer <session key>" if key is None
                             else "unknown or expired session key (start one with /rl/start_session)")
        if session is not None:
            session.check_open()
        return session

    def token_text(self, token_id: int) -> str:
        s = self._token_text_cache.get(token_id)
        if s is None:
            s = self._token_text_cache[token_id] = self.tokenizer.decode([token_id])
        return s

    async def chat(self, session: Session | None, req: ChatRequest, *,
                   owned: bool = False) -> tuple[str, Any, dict[str, Any], float]:
        """Forward one chat turn; record it into ``session`` (``None``: pass through unrecorded).
        ``owned``: ``req.messages`` were parsed from the wire for this call and may be recorded
        without a deep copy.

        Returns ``(interaction id, ModelResponse, assistant message, seconds spent waiting on the
        upstream)``. Upstream failures are a 502 and leave no record; cancellation removes the
        in-flight record too.
        """
        self._check_open("chat")
        concat = self.config.chat_template_type == "concat"
        tools = req.tools
        if tools is not None and not self._renders_tools():
            name = getattr(self.tokenizer, "name_or_path", None) or type(self.tokenizer).__name__
            raise ProxyError(400, f"tools: the chat template of the proxy's tokenizer ({name}) does not render "
                                  "tools; serve a model whose template supports them (e.g. Qwen2.5/3)", param="tools")
        tool_list = tools.tools if tools is not None else None
        rec: Record | None = (session.begin(req.messages, concat=concat, owned=owned, tools=tool_list)
                              if session is not None else None)
        prefill = tools.prefill(self.tool_parser) if tools is not None else ""
        try:
            prompt = (self.prompts.prompt(rec) if rec is not None and concat
                      else self.prompts.fresh(req.messages, tool_list))
            if prefill:  # tool_choice required / named: the call's opening is prompt (rollout.tool_calls)
                prompt = [*prompt, *self.tokenizer.encode(prefill)]
            room = None
            if self.config.max_context_tokens is not None:
                room = self.config.max_context_tokens - len(prompt)
                if room < 1:
                    raise ProxyError(400, f"the prompt has {len(prompt)} tokens, which leaves no room for a response "
                                          f"within max_context_tokens={self.config.max_context_tokens}",
                                     param="messages")
            params = req.sampling(self.config.default_max_tokens, room,
                                  default_seed=session.sampling_seed(rec) if rec is not None else None)
            gen = await self.client.generate(prompt, params, route_key=session.id if session is not None else None)
        except BaseException as e:
            if rec is not None:  # nothing is recorded for a turn that did not complete
                session.abort(rec)
            if isinstance(e, GenerationError):
                self.counters["upstream_errors"] += 1
                raise ProxyError(502, f"upstream generation failed: {e}") from e
            raise
        resp = gen.response
        text = gen.text if gen.text is not None else self.tokenizer.decode(resp.output_tokens.tolist())
        self.counters["chats"] += 1
        parsed = tools.finish(self.tool_parser, text) if tools is not None else ParsedOutput(text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.calls]
            self.counters["tool_calls"] += len(parsed.calls)
        self.counters["tool_call_parse_failures"] += int(parsed.failed)
        if rec is None:
            self.counters["passthrough"] += 1
            return f"chatcmpl-passthrough-{self.counters['passthrough']}", resp, message, gen.http_s
        session.complete(rec, resp, prefill + text, message)
        return rec.id, resp, rec.output_message, gen.http_s

    async def respond(self, session: Session | None, body: Any) -> dict[str, Any]:
        """One ``POST /v1/responses`` turn (``rollout.responses_api``): translated to a chat turn,
        recorded exactly like one (the response ``id`` is the interaction id), and stored for
        ``previous_response_id`` on its session (removed with it)."""
        def error(message: str, param: str) -> ProxyError:
            return ProxyError(400, message, param=param)

        if not isinstance(body, Mapping):
            raise error("the request body must be a JSON object", "body")
        prev = body.get("previous_response_id")
        store = session.responses if session is not None else self.responses
        history = store.get(prev, error) if prev is not None else None
        req = parse_chat_request(to_chat_body(body, history, error))
        rid, resp, message, _ = await self.chat(session, req, owned=True)
        store.put(rid, conversation(req.messages, message, body.get("instructions")))
        truncated = resp.stop_reason == "length" and not message.get("tool_calls")
        return response_object(rid, self.config.model_name, message, body, input_tokens=resp.input_len,
                               output_tokens=resp.output_len, truncated=truncated)

    def _renders_tools(self) -> bool:
        """Whether the tokenizer's chat template shows ``tools`` to the model (probed once)."""
        if self._tools_ok is None:
            self._tools_ok = template_renders_tools(lambda msgs, tools: self.prompts.builder.render(msgs, True, tools))
        return self._tools_ok

    # ------------------------------------------------------------------ export

    async def export(self, request: ExportRequest | Mapping[str, Any]) -> ExportResult:
        """Claim, score and turn into rows (see the module docstring)."""
        req = request if isinstance(request, ExportRequest) else ExportRequest.from_body(request)
        self._check_open("export")
        req.validate(scoring=self.scoring)
        sessions = {sid: self.store.by_id.get(sid) for sid in req.session_ids}
        if req.style == "concat":
            for sid, s in sessions.items():
                if s is not None and any(not r.concat for r in s.selected(req.trajectory_id)):
                    raise ProxyError(400, f"session {sid!r} has records made with chat_template_type 'hf'; they "
                                          "cannot be exported concat (use style 'individual')", param="style")
        # ---- claim: synchronous, nothing awaited since the lookups above (consume once) ----
        claimed = {sid: (s, s.claim(req.trajectory_id)) for sid, s in sessions.items() if s is not None}
        task = asyncio.current_task()
        if task is not None:
            self._exports.add(task)
        try:
            return await self._export_claimed(req, sessions, claimed)
        finally:
            if task is not None:
                self._exports.discard(task)
            if req.remove_session:
                for s, _ in claimed.values():
                    self.store.remove(s)

    async def _export_claimed(self, req: ExportRequest, sessions: Mapping[str, Session | None],
                              claimed: Mapping[str, tuple[Session, list[tuple[int, list[Record]]]]]) -> ExportResult:
        self.counters["exports"] += 1
        n_records = sum(len(recs) for _, trajs in claimed.values() for _, recs in trajs)
        gen_tokens = sum(r.response.output_len for _, trajs in claimed.values() for _, recs in trajs for r in recs)
        if req.discard_trajectory:
            self.counters["discarded_exports"] += 1
            return ExportResult(rows=[], discarded=True, records=n_records, generated_tokens=gen_tokens)
        missing = [sid for sid in req.session_ids if sessions[sid] is None or not claimed[sid][1]]
        if missing:
            self.counters["rejected_groups"] += 1
            why = "unknown session" if sessions[missing[0]] is None else "no ready trajectory (no reward set, or already exported)"
            return ExportResult(rows=[], rejected={"reason": "missing_session", "session_ids": missing,
                                                   "message": f"session {missing[0]!r}: {why}; the group is rejected"},
                                records=n_records, generated_tokens=gen_tokens)
        prm_stats = None
        token_rewards: dict[tuple[str, int], Any] = {}
        if self.scoring:
            trees, ctxs, keys = {}, {}, {}
            for sid, (s, trajs) in claimed.items():
                for tid, recs in trajs:
                    k = sid if len(trajs) == 1 else f"{sid}#{tid}"
                    trees[k] = trajectory_tree(recs)
                    ctxs[k] = {"session_id": sid, "task_id": s.task_id, "group_id": s.group_id, "trajectory_id": tid}
                    keys[k] = (sid, tid)
            prm_stats, failed = await score_sessions(self.runner, trees, ctxs, is_eval=req.is_eval)
            if failed:
                self.counters["rejected_groups"] += 1
                k, err = next(iter(failed.items()))
                return ExportResult(rows=[], prm_stats=prm_stats, rejected={
                    "reason": "scoring_failed", "session_ids": sorted({keys[k][0] for k in failed}),
                    "message": f"session {keys[k][0]!r}: {type(err).__name__}: {err}; the group is rejected"},
                    records=n_records, generated_tokens=gen_tokens)
            for k, sc in prm_stats.sessions.items():
                token_rewards[keys[k]] = sc.token_rewards
        rows: list[ProxyRow] = []
        for sid, (s, trajs) in claimed.items():
            for tid, recs in trajs:
                if req.style == "concat":
                    rows.extend(concat_rows(sid, s.group_id, tid, recs, discount=req.discount,
                                            token_rewards=token_rewards.get((sid, tid)) if self.scoring else None))
                else:
                    rows.extend(individual_rows(sid, s.group_id, tid, recs, discount=req.discount))
        masked = sum(r.masked_turns for r in rows)
        if masked:
            self.counters["masked_turns"] += masked
            logger.warning("export: %d turn(s) did not extend their parent's row and were masked out", masked)
        self.counters["exported_rows"] += len(rows)
        return ExportResult(rows=rows, prm_stats=prm_stats, records=n_records, generated_tokens=gen_tokens)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        """Counters, live sessions and the proxy's own time per chat turn: the chat route from its
        start to the built answer, minus the time spent waiting on the upstream."""
        o = np.asarray(self.overhead_s, np.float64) * 1e3
        return {
            **self.counters, **self.store.counters, "live_sessions": len(self.store),
            "overhead_ms": {"n": int(o.size), "p50": float(np.percentile(o, 50)) if o.size else None,
                            "p99": float(np.percentile(o, 99)) if o.size else None},
        }
