"""Rollout layer: token-backed interaction types (layer 2) and, above the scorers, the client,
environments, tree builder and export to ``jaxprm.Batch`` (layer 4)."""

from rollout.types import Interaction, InteractionTree, ModelResponse

__all__ = ["Interaction", "InteractionTree", "ModelResponse"]
