"""EP in one process. For model tests, two ranks: rank 1's MoE layers record their local
expert functions (and contribute nothing), then rank 0's comm adds rank 1's share to its own,
as dispatch and combine would. For engine tests, ``Framed``: one rank run from encoded frames,
as every EP rank is."""

from __future__ import annotations

import torch

from epserve.worker import ep_results as R
from epserve.worker import step_command as P


class RecordingComm:
    """Stands in for rank 1: records its local expert functions, contributes nothing itself."""

    def __init__(self):
        self.local_fns = []

    def moe_forward(self, x, topk_ids, topk_weights, local_fn):
        self.local_fns.append(local_fn)
        return torch.zeros_like(x)


class LoopbackComm:
    """Rank 0's comm: its own experts plus rank 1's, as dispatch/combine would give."""

    def __init__(self, peer_fns):
        self.peer_fns, self.calls = peer_fns, 0

    def moe_forward(self, x, topk_ids, topk_weights, local_fn):
        peer = self.peer_fns[self.calls]
        self.calls += 1
        return local_fn(x, topk_ids, topk_weights) + peer(x, topk_ids, topk_weights)


class Framed:
    """``EpChannel`` with one rank and no collectives: the command is encoded, the rank runs
    it from the frame (``RankExecutor.step``, as every EP rank does) and its result is read
    back from its frame under the rank's limits, as the leader reads each rank's. Install it
    as ``llm.model.channel = Framed(llm.model.rank0)``."""

    def __init__(self, rank0):
        self.rank0 = rank0

    def run(self, cmd: P.StepCommand) -> list:
        frame = self.rank0.step(P.encode(cmd))
        return [] if frame is None else [R.decode_result(frame, self.rank0.limits)]
