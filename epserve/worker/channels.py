"""How a step command reaches the ranks and their results come back: ``LocalChannel`` (one
rank: rank 0's executor runs the command object, nothing encoded) and ``EpChannel`` (N ranks:
encoded, broadcast, every rank's result gathered). Invariant: a failure of the channel or of
rank 0's forward is a ``RankFailure``; a command every rank refuses is ``EpCommandFailed``.
"""

from __future__ import annotations

from typing import Any

from epserve.models.traits import EpCommandFailed, RankFailure
from epserve.worker.ep_results import RankResult, decode_result
from epserve.worker.rank_executor import RankExecutor
from epserve.worker.step_command import StepCommand, encode


class LocalChannel:
    """One rank: rank 0's executor runs the command object itself; nothing is encoded."""

    def __init__(self, rank0: RankExecutor):
        self.rank0 = rank0

    def run(self, cmd: StepCommand) -> list[RankResult]:
        res = self.rank0.run(cmd)
        return [] if res is None else [res]


class EpChannel:
    """N ranks: encode, broadcast, run rank 0's part, gather every rank's result. A failure
    of the channel or of rank 0's forward is a ``RankFailure``."""

    def __init__(self, rank0: RankExecutor, comm: Any):
        self.rank0, self.comm = rank0, comm

    def run(self, cmd: StepCommand) -> list[RankResult]:
        frame = encode(cmd)
        try:
            self.comm.broadcast_bytes(frame, src=0)
        except Exception as exc:
            raise RankFailure(f"broadcast of step {cmd.step_id} failed: {exc}") from exc
        try:
            mine = self.rank0.step(frame)
        except EpCommandFailed:
            raise
        except Exception as exc:
            raise RankFailure(f"step {cmd.step_id} failed on rank 0: {exc}") from exc
        if mine is None:  # shutdown
            return []
        try:
            frames = self.comm.gather_bytes(mine, dst=0)
        except Exception as exc:
            raise RankFailure(f"gathering step {cmd.step_id} failed: {exc}") from exc
        return [decode_result(f, self.rank0.limits) for f in frames]
