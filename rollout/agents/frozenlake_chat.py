"""FrozenLake through the recording proxy: ``rollout.agents.grid_chat`` with ``env="frozenlake"``
(the trainer's default ``agent.workflow``)."""

from __future__ import annotations

from typing import Any

from rollout.agents import grid_chat

__all__ = ["run"]


async def run(task: Any, base_url: str, api_key: str, http_client: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Play one FrozenLake episode through the proxy (``grid_chat.run``'s keyword arguments)."""
    return await grid_chat.run(task, base_url, api_key, http_client, env="frozenlake", **kwargs)
