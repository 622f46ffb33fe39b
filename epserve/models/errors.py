"""The failure types of the model interface (re-exported by ``models.traits``, the seed's
names): a refused step command, a broken EP group, an absent capability."""

from __future__ import annotations

from typing import Sequence


class EpCommandFailed(RuntimeError):
    """An EP step command that was received and then failed to execute (validation or run).

    Every rank reaches the same verdict on the same bytes: a worker logs it and keeps going.
    ``bad_rows``: the ``(rank, slot)`` of the sequence whose rows or updates made the command
    invalid, when one did; the leader then fails just that sequence and re-issues the step
    without it. Empty: no one sequence is to blame, and the whole step fails.
    """

    def __init__(self, step_id: int, reason: str,
                 bad_rows: Sequence[tuple[int, int]] = ()):
        super().__init__(f"EpCommandFailed(step {step_id}): {reason}")
        self.step_id = step_id
        self.reason = reason
        self.bad_rows = tuple(bad_rows)


class RankFailure(RuntimeError):
    """A rank died or a collective failed: the step cannot be agreed on, the EP group must be
    re-formed. Unlike ``EpCommandFailed`` this fails every in-flight request."""


class CapabilityAbsent(NotImplementedError):
    """A request needed a capability this runner does not declare in ``capabilities()``."""
