"""The two ways a rollout command says no."""

from __future__ import annotations


class RolloutError(ValueError):
    """The request was refused; nothing was changed."""


class NotReady(RolloutError):
    """KServe has not made the new revision or deployment ready yet: try again (or --wait)."""
