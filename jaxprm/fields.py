"""``FieldError``: how the library configs (``rollout.TreeConfig``, ``jaxprm.AdvantageConfig``, ...)
report a bad value. Each config validates its own fields once, in ``__post_init__``; the error names
the field (dotted inside the config: ``arpo.beam_size``) and the config class, so the trainer, which
composes these configs into its YAML sections, can name the full key (``rollout.arpo.beam_size``).
jax-free and project-free, so every layer may use it."""

from __future__ import annotations

__all__ = ["FieldError", "require"]


class FieldError(ValueError):
    """``field: message`` for the config class ``owner`` (``field`` and ``owner`` are attributes)."""

    def __init__(self, field: str, message: str, owner: type | None = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.owner = field, message, owner

    def __reduce__(self):
        return FieldError, (self.field, self.message, self.owner)


def require(ok: bool, field: str, message: str, owner: type | None = None) -> None:
    """Raise :class:`FieldError` ``(field, message, owner)`` unless ``ok``."""
    if not ok:
        raise FieldError(field, message, owner)
