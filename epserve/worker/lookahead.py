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

Invariants: a lookahead forward writes KV only at each row's next position (``seq_len``), in a
block its sequence holds (taken here when the position opens a block and the pool has one free,
as the scheduler would before the next step). That position is beyond the sequence's valid KV,
so if the head finishes, preempts or changes the sequence instead, what was written is never
read (the prefix cache keeps full blocks below ``seq_len`` only), and one stream orders it
before any later use of the block. A row whose next token is its last
(``SequenceState.lookahead`` false, set by the head) turns the lookahead off for that step.
Sampling never runs ahead: a step's tokens are drawn from its own logits when the head asks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from epserve.models.traits import SequenceState
from epserve.worker.batch import BlockTables, build_step_inputs
from epserve.worker.cuda_graphs import DecodeGraphs
from epserve.worker.sampler import PendingSample

Forward = Callable[..., torch.Tensor]


@dataclass
class _Ahead:
    """One queued lookahead forward: which rows, where, and its output."""

    seqs: tuple[SequenceState, ...]
    positions: list[int]
    blocks: list[int]  # the KV block holding each row's position
    hidden: torch.Tensor  # [n, H]
    tokens: list[int] | None = None  # the ids it was fed, once the host has read them


class DecodeLookahead:
    """Queues and matches one lookahead decode forward for a runner (one rank).

    ``graphs``: replay the decode graphs (None: run ``forward`` eagerly, the CPU test path);
    ``reserve(seq, num_tokens) -> bool``: the runner's block reservation."""

    def __init__(self, forward: Forward, graphs: DecodeGraphs | None, tables: BlockTables,
                 block_size: int, device: torch.device, max_model_len: int,
                 reserve: Callable[[SequenceState, int], bool]):
        self.forward, self.graphs, self.tables = forward, graphs, tables
        self.block_size, self.device, self.max_model_len = block_size, device, max_model_len
        self.reserve = reserve
        self._ahead: _Ahead | None = None
        self.launched = self.hits = 0

    def launch(self, seqs: Sequence[SequenceState], pending: PendingSample) -> bool:
        """Queue the next decode forward of ``seqs`` fed ``pending.tokens`` (one per row), after
        starting ``pending``'s read-back so the forward does not delay it. False when not
        launched: a row without a next step, no graph for the rows, or no KV block free."""
        self._ahead = None
        n = len(seqs)
        if n == 0 or pending.tokens.shape[0] != n:
            return False
        if self.graphs is not None and not self.graphs.covers_rows(n):
            return False
        if not all(s.lookahead and s.seq_len < self.max_model_len for s in seqs):
            return False
        if not all(self.reserve(s, s.seq_len + 1) for s in seqs):
            return False
        try:
            inp = build_step_inputs([0] * n, seqs, (), self.tables, self.block_size, self.device)
        except ValueError:  # a row the head's next step could not run either: it will say so
            return False
        pending.copy_async()
        if self.graphs is not None:
            hidden = self.graphs.run(inp, input_ids=pending.tokens)
        else:
            hidden = self.forward(pending.tokens, inp.positions, inp.meta)
        bs = self.block_size
        self._ahead = _Ahead(tuple(seqs), [s.seq_len for s in seqs],
                             [s.block_table[s.seq_len // bs] for s in seqs], hidden)
        self.launched += 1
        return True

    def fed(self, tokens: list[int]) -> None:
        """The ids the queued forward was fed, as the host read them back."""
        if self._ahead is not None:
            self._ahead.tokens = tokens

    def take(self, decode_tokens: Sequence[int],
             decode_seqs: Sequence[SequenceState]) -> torch.Tensor | None:
        """The queued forward's hidden states [n, H] if this pure decode step is exactly the
        one it computed, else None (and it is dropped either way)."""
        a, self._ahead = self._ahead, None
        if a is None or a.tokens is None or len(decode_seqs) != len(a.seqs):
            return None
        if list(decode_tokens) != a.tokens:
            return None
        bs = self.block_size
        for s, t, p, b in zip(decode_seqs, a.seqs, a.positions, a.blocks):
            if s is not t or s.seq_len != p or len(s.block_table) <= p // bs \
                    or s.block_table[p // bs] != b:
                return None
        self.hits += 1
        return a.hidden

    def discard(self) -> None:
        self._ahead = None
