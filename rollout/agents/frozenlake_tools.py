"""FrozenLake through the recording proxy by ``move`` function calls: ``rollout.agents.grid_tools``
with ``env="frozenlake"`` (``configs/agent_frozenlake_tools.yaml``)."""

from __future__ import annotations

from typing import Any

from rollout.agents import grid_tools

__all__ = ["run"]


async def run(task: Any, base_url: str, api_key: str, http_client: Any = None, **kwargs: Any) -> dict[str, Any]:
    """Play one FrozenLake episode through the proxy by tool calls (``grid_tools.run``'s keyword arguments)."""
    return await grid_tools.run(task, base_url, api_key, http_client, env="frozenlake", **kwargs)
