"""The errors of a weight update. Each is an ``ebbtide.errors`` type (catch ``StateError`` /
``InvalidArgumentError`` to handle them with the rest); the receiver keeps its last complete version."""
from __future__ import annotations

from ..errors import InvalidArgumentError, StateError

__all__ = ["WeightVersionError", "PartialUpdateError", "PlanMismatchError"]


class WeightVersionError(StateError):
    """An update or a bucket of another version than the one in progress or expected (a stale or repeated
    version, or two updates mixed). Nothing was applied."""


class PartialUpdateError(StateError):
    """An update ended before every bucket arrived (the sender or receiver went away, a bucket was missing or
    overwritten while read). Nothing was applied; the receiver holds its previous version."""


class PlanMismatchError(InvalidArgumentError):
    """Sender and receiver disagree on what is sent (names, shapes, dtypes, kinds or bucketing): the message says
    where. Nothing was sent or applied."""
