"""Two EP ranks in one process, for model tests: rank 1's MoE layers record their local expert
functions (and contribute nothing), then rank 0's comm adds rank 1's share to its own, as
dispatch and combine would."""

from __future__ import annotations

import torch


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
