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


async def dies_once(task, base_url, api_key, http_client, marker: str, **kw):
    """The example chat agent, except that the first call anywhere kills its process."""
    import os

    from rollout.agents.frozenlake_chat import run

    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)
    return await run(task, base_url, api_key, http_client, **kw)
