"""Decode lookahead: the next decode step's forward is queued on the device before the host has
read this step's tokens, so the host's work between two steps (reading the tokens back, the
head's stop checks, detokenization and scheduling, building the next inputs) runs while the GPU
computes instead of leaving it idle.

After a pure decode step has sampled (its tokens still on the device), ``launch`` queues the
forward of those tokens for the same rows at their next positions, the step the head most likely
asks for next, feeding the sampled ids straight from the device. ``take`` hands that forward's
hidden states to the next step only when the step is exactly it: the same sequences in the same
order, fed the tokens just sampled, each at the position and KV block the forward used. Any other
step discards it and runs as usual; a miss costs one forward of GPU time, never a wrong token.

A step that will not be it is known sometimes before the forward is queued: a request arrived
(or an abort came) while this step ran, so the next step takes new rows. ``arrivals`` (set by
whoever feeds the engine, e.g. ``head.async_engine``) says so; then nothing is queued, since the
forward would be dropped and the next step would wait behind it on the stream.

Invariants: a lookahead forward writes KV only at each row's next position, in a block its
slot already holds (the step model ships that block with a step it marks ``ahead``; without it
nothing is queued). That position is beyond the sequence's valid KV, so if the head finishes,
preempts or changes the sequence instead, what was written is never read (the prefix cache
keeps full blocks below ``seq_len`` only), and one stream orders it before any later use of the
block. Only a step marked ``ahead`` queues one: a step whose rows' next token is not known to
be their last. Sampling never runs ahead: a step's tokens are drawn from its own logits.

A model with recurrent state (gated DeltaNet) advances each row's state in place, which a
discarded forward must not leave behind: with ``state_pools`` (the runner's state tensors,
``[L, N, ...]`` with every layer's slots on dim 1, ``models.layer_cache.allocate_states``) the
rows' states are copied aside before the forward is queued, one strided copy per row and
tensor, and copied back when it is dropped (``take`` misses, ``discard``); so only steps of at most
``max_state_rows`` rows run ahead (the copy reads and writes each row's whole state: at the
Qwen3.5-35B-A3B shape 63 MB a row, ~30 us of HBM time against the ~0.6 ms of host work a step
it hides).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from epserve.worker.batch import BlockTables, RankRows, build_step_inputs
from epserve.worker.step_buffers import StepBuffers
from epserve.worker.cuda_graphs import DecodeGraphs
from epserve.worker.sampler import PendingSample

Forward = Callable[..., torch.Tensor]


@dataclass
class _Ahead:
    """One queued lookahead forward: which slots, at which positions, in which KV blocks, and
    its output."""

    slots: np.ndarray
    positions: np.ndarray
    blocks: np.ndarray
    hidden: torch.Tensor  # [n, H]
    tokens: np.ndarray | None = None  # the ids it was fed, once the host has read them


class DecodeLookahead:
    """Queues and matches one lookahead decode forward for a runner (one rank).

    ``graphs``: replay the decode graphs (None: run ``forward`` eagerly, the CPU test path)."""

    def __init__(self, forward: Forward, graphs: DecodeGraphs | None, tables: BlockTables,
                 block_size: int, device: torch.device, max_model_len: int,
                 state_pools: list[torch.Tensor] | None = None, max_state_rows: int = 4,
                 buffers: StepBuffers | None = None):
        self.forward, self.graphs, self.tables = forward, graphs, tables
        self.buffers = buffers  # the Runner's step-input ring (the queued step's inputs)
        self.block_size, self.device, self.max_model_len = block_size, device, max_model_len
        self._ahead: _Ahead | None = None
        self.launched = self.hits = self.restored = self.held_back = 0
        #: True when the next step will take new rows (requests arrived meanwhile): no launch
        self.arrivals: Callable[[], bool] | None = None
        self.state_pools = state_pools or []
        self.max_state_rows = max_state_rows
        # the rows' states before the queued forward: room for max_state_rows slots of each
        # tensor (flat, so that the first n rows' copy is one contiguous [L, n, ...]), and
        # their slots
        self._saved = [torch.empty(p[:, :max_state_rows].numel(), dtype=p.dtype,
                                   device=p.device) for p in self.state_pools]
        self._saved_slots: list[int] | None = None

    def launch(self, rows: RankRows, nblocks: np.ndarray, pending: PendingSample) -> bool:
        """Queue the next decode forward of ``rows``' slots fed ``pending.tokens`` (one per
        row), after starting ``pending``'s read-back so the forward does not delay it.
        ``nblocks``: each row's block count. False when not launched: prefill rows, no graph
        for the rows, or a row without a block for its next position."""
        self.discard()  # (taken or dropped by the step's prepare already)
        n = rows.num_decode
        if n == 0 or rows.chunked or rows.verify or pending.tokens.shape[0] != n:
            return False
        if self.graphs is not None and not self.graphs.covers_rows(n):
            return False
        if self.state_pools and n > self.max_state_rows:
            return False
        if self.arrivals is not None and self.arrivals():  # the next step takes new rows
            self.held_back += 1
            return False
        nxt = rows.decode_pos + 1
        if int(nxt.max()) >= self.max_model_len or (nxt // self.block_size >= nblocks).any():
            return False
        ahead = RankRows(rows.decode_slots, nxt, np.zeros(n, dtype=np.int64), (), [], [])
        inp = build_step_inputs(ahead, self.tables, self.block_size, self.device,
                                bool(self.state_pools), self.buffers)
        pending.copy_async()
        if self.state_pools:
            self._save(rows.decode_slots)
        if self.graphs is not None:
            hidden = self.graphs.run(inp, input_ids=pending.tokens)
        else:
            hidden = self.forward(pending.tokens, inp.positions, inp.meta)
        self._ahead = _Ahead(rows.decode_slots, nxt, self._blocks(rows.decode_slots, nxt), hidden)
        self.launched += 1
        return True

    def _blocks(self, slots: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return self.tables.np[slots, pos // self.block_size].copy()

    def fed(self, tokens: np.ndarray) -> None:
        """The ids the queued forward was fed, as the host read them back."""
        if self._ahead is not None:
            self._ahead.tokens = tokens

    def take(self, rows: RankRows) -> torch.Tensor | None:
        """The queued forward's hidden states [n, H] if ``rows`` (a pure decode step) are
        exactly the ones it computed, else None (and it is dropped either way)."""
        a = self._ahead
        if a is None:
            return None
        if a.tokens is None or rows.chunked or rows.verify or rows.num_decode != len(a.slots) \
                or not (np.array_equal(rows.decode_slots, a.slots)
                        and np.array_equal(rows.decode_pos, a.positions)
                        and np.array_equal(rows.decode_ids, a.tokens)
                        and np.array_equal(self._blocks(a.slots, a.positions), a.blocks)):
            self.discard()
            return None
        self._ahead = self._saved_slots = None
        self.hits += 1
        return a.hidden

    def discard(self) -> None:
        """Drop the queued forward; the states it advanced go back to what they were."""
        self._ahead = None
        if self._saved_slots is not None:
            slots, self._saved_slots = self._saved_slots, None
            for pool, saved in zip(self.state_pools, self._saved):
                rows = self._rows(pool, saved, len(slots))
                for i, slot in enumerate(slots):
                    pool[:, slot].copy_(rows[:, i])
            self.restored += 1

    @staticmethod
    def _rows(pool: torch.Tensor, saved: torch.Tensor, n: int) -> torch.Tensor:
        """``saved``'s first n rows of every layer, ``[L, n, ...]`` contiguous."""
        return saved[:pool[:, :n].numel()].view(pool.shape[0], n, *pool.shape[2:])

    def _save(self, slots: np.ndarray) -> None:
        """Copy the rows' states aside (on the stream, before the forward that advances
        them): per row a strided copy of its ``[L, ...]`` (the slots are host ints, so no
        index tensor crosses to the device and no gather kernel does index arithmetic per
        element; at one row that is one launch per tensor, as before)."""
        self._saved_slots = [int(x) for x in slots]
        for pool, saved in zip(self.state_pools, self._saved):
            rows = self._rows(pool, saved, len(slots))
            for i, slot in enumerate(self._saved_slots):
                rows[:, i].copy_(pool[:, slot])
