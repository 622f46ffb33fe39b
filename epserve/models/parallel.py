"""Parallel placement of a model on one rank (passed in explicitly, never a module global).

Invariants: rank r of ``world_size`` holds experts ``[r*E/N, (r+1)*E/N)``; E must divide
evenly. ``ep_comm`` is the expert-parallel communicator (built in ``worker/``) or ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelInfo:
    """This rank's place among ``world_size`` EP ranks, and its EP communicator.

    ``ep_comm`` must offer ``moe_forward(x, topk_ids, topk_weights, local_fn) -> [T, H]`` when
    ``world_size > 1`` (see ``models.layers.SparseMoeBlock``).
    """

    rank: int = 0
    world_size: int = 1
    ep_comm: object | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"ParallelInfo: need 0 <= rank < world_size, got rank={self.rank} "
                             f"world_size={self.world_size}")

    def local_expert_range(self, num_experts: int) -> tuple[int, int]:
        """The [start, end) global expert ids this rank holds."""
        if num_experts % self.world_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by "
                             f"world_size={self.world_size}: experts cannot be sharded evenly")
        per_rank = num_experts // self.world_size
        return self.rank * per_rank, (self.rank + 1) * per_rank
