"""Workflows for ``test_agent_process.py`` (importable by the agent process: a child re-imports them)."""

from __future__ import annotations

import asyncio


async def crash(task, base_url, api_key, http_client, **kw):
    raise RuntimeError(f"the agent crashed on {task}")


async def slow(task, base_url, api_key, http_client, seconds: float = 60.0, **kw):
    await asyncio.sleep(seconds)
    return 1.0


async def unpicklable(task, base_url, api_key, http_client, **kw):
    return {"reward": lambda: 1.0}


def not_async(task, base_url, api_key, http_client, **kw):
    return 1.0
