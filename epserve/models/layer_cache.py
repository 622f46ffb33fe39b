"""What each layer of a model keeps between steps, described for the runner that allocates it.

A model's ``layer_cache_specs()`` returns one spec per layer, in layer order; the runner
allocates from it and hands ``forward`` one cache per layer:

- ``KvCacheSpec`` (full attention): a paged ``(k_cache, v_cache)``, each
  ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the KV dtype;
- ``StateCacheSpec`` (linear attention, gated DeltaNet): ``(conv_state, recurrent_state)``
  over the rank's N state slots, ``[N, *conv_shape]`` in ``conv_dtype`` and
  ``[N, *recurrent_shape]`` in ``recurrent_dtype`` (float32), indexed by the slots of
  ``AttentionMetadata.state_slots``. N is the runner's sequence slots plus one spare scratch
  slot that padded rows point at.

Invariant: a state slot's size does not depend on the sequence's length.

``allocate_states`` gives the layers of one state spec views of one tensor per state kind,
``[L, N, *shape]`` (layer ``l``'s pool is its contiguous ``[l]``), so a copy of some slots'
states across every layer is one launch per kind (the decode lookahead's copy aside), not one
per layer and kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KvCacheSpec:
    """A full-attention layer: paged K and V of ``num_kv_heads`` heads of ``head_dim``."""

    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token in ``dtype``."""
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize


@dataclass(frozen=True)
class StateCacheSpec:
    """A linear-attention layer: per slot a conv state ``conv_shape`` = (channels, kernel - 1)
    and a recurrent state ``recurrent_shape`` = (value heads, key dim, value dim)."""

    conv_shape: tuple[int, int]
    recurrent_shape: tuple[int, int, int]
    conv_dtype: torch.dtype
    recurrent_dtype: torch.dtype = torch.float32

    def bytes_per_slot(self) -> int:
        """Both states of one slot."""
        return (math.prod(self.conv_shape) * self.conv_dtype.itemsize
                + math.prod(self.recurrent_shape) * self.recurrent_dtype.itemsize)

    def allocate(self, num_slots: int, device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed ``(conv_state, recurrent_state)`` for ``num_slots`` slots on ``device``."""
        return (torch.zeros(num_slots, *self.conv_shape, dtype=self.conv_dtype, device=device),
                torch.zeros(num_slots, *self.recurrent_shape, dtype=self.recurrent_dtype,
                            device=device))


LayerCacheSpec = KvCacheSpec | StateCacheSpec


def allocate_states(specs: list[StateCacheSpec], num_slots: int, device: torch.device | str
                    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Zeroed states of ``num_slots`` slots for each of ``specs`` (in order), layers of equal
    specs sharing one tensor per state kind. Returns each spec's ``(conv_state,
    recurrent_state)`` (``[N, *shape]``, contiguous) and the shared tensors, ``[L, N,
    *shape]`` each (the slots on dim 1)."""
    groups: dict[StateCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault(spec, []).append(i)
    pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(specs)
    shared: list[torch.Tensor] = []
    for spec, layers in groups.items():
        conv = torch.zeros(len(layers), num_slots, *spec.conv_shape, dtype=spec.conv_dtype,
                           device=device)
        rec = torch.zeros(len(layers), num_slots, *spec.recurrent_shape,
                          dtype=spec.recurrent_dtype, device=device)
        for j, i in enumerate(layers):
            pairs[i] = (conv[j], rec[j])
        shared += [conv, rec]
    return pairs, shared
