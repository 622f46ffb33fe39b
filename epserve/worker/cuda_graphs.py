"""Decode forwards captured as CUDA graphs: one row, then one per rung of ``DECODE_BATCH_LADDER``.

A pure decode step of ``n`` rows replays the graph of rung ``padded_batch_n(n)`` (one row: a
graph of its own, see ``graph_batch``): the step's inputs are copied into the graph's static
buffers, rows ``n..rung`` are padding. Invariants (the seed's): a padded row has KV slot -1 (it
writes no KV) and length 1 (it reads one KV position of block 0, harmlessly), and its hidden
state is never read; on one rank the fused router also gives it no expert (slot < 0). Above the ladder's top
rung (128), where ``padded_batch_n`` pads nothing, graphs are captured every
``ABOVE_LADDER_STEP`` rows up to ``max_batch`` (a step pads to the next of those: the same
padding rules; without them a 256-row decode step would pay the host's launch cost of every
kernel). Steps with any prefill row run eagerly. Everything the captured
forward reads per step lives in the static buffers below; lengths reach attention through
``AttentionMetadata.seq_lens_t`` (the host tuple holds placeholders at capture time).

A model with recurrent state captures a second set for speculative verify steps (``runs``):
the same rows for attention, and the recurrent layers' ``StateRuns`` in static buffers too
(offsets, state slots, fresh and hold flags, with ``rows`` sequences at most: a rung's grid),
so one graph replays any grouping of its rows into runs of up to ``MAX_SHORT_TOKENS``. A
step's runs are followed by its padding rows, one held one-row run each on the spare slot,
then empty held runs; each layer's logged projections (``StateRuns.log``, what the fold
reads) are the graph's own tensors, valid until the next replay; with ``fold`` each rung has
a second graph that folds the accepted prefixes in from them (``replay_fold``).

Only for a single rank: an EP step's expert exchange runs collectives on a host-driven group,
which a graph cannot replay.
"""

from __future__ import annotations

import array
import functools
import logging
import time
from typing import Callable

import numpy as np
import torch

from epserve.kernels.attention import AttentionMetadata, StateRuns
from epserve.models.traits import DECODE_BATCH_LADDER, padded_batch_n
from epserve.worker.batch import StepInputs

log = logging.getLogger(__name__)

#: Rows between the graphs captured above the ladder's top rung.
ABOVE_LADDER_STEP = 32

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch(n: int) -> int:
    """The graph size a decode step of ``n`` rows replays: 1 for one row, ``padded_batch_n``
    on the rest of the ladder, the next multiple of ``ABOVE_LADDER_STEP`` above it.

    One row gets a graph of its own below the ladder's first rung (2): its padding row would
    route to 8 more experts and double the MoE's weight reads (20.9 instead of 11.7 us per
    GEMM on the H200), and a one-row step takes the GEMV path of the projections."""
    if n == 1:
        return 1
    if n <= DECODE_BATCH_LADDER[-1]:
        return padded_batch_n(n)
    return -(-n // ABOVE_LADDER_STEP) * ABOVE_LADDER_STEP


class DecodeGraphs:
    """The captured decode graphs of one runner and their static input buffers.

    ``forward(input_ids [B] int64, positions [B] int64, meta) -> hidden [B, H]`` is the model
    forward over the runner's KV caches. ``max_batch`` caps the rungs captured (the runner's
    ``max_num_seqs``); ``max_blocks`` is the block-table width (``max_model_len`` in blocks).
    """

    def __init__(self, forward: Forward, device: torch.device, block_size: int,
                 max_batch: int, max_blocks: int, spare_state_slot: int | None = None,
                 runs: bool = False, fold: Callable[[list, StateRuns], None] | None = None):
        self.forward, self.device, self.block_size = forward, device, block_size
        self.rungs = [1] * (not runs) + [r for r in DECODE_BATCH_LADDER
                                         if r <= graph_batch(max_batch)]
        top = DECODE_BATCH_LADDER[-1]
        self.rungs += list(range(top + ABOVE_LADDER_STEP, graph_batch(max_batch) + 1,
                                 ABOVE_LADDER_STEP))
        top = max(self.rungs, default=0)
        self.max_rows = top
        self.input_ids = torch.zeros(top, dtype=torch.int64, device=device)
        self.positions = torch.zeros(top, dtype=torch.int64, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((top, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        # a model with recurrent state: each row's state slot; padding rows use the spare one
        self.spare_state_slot = spare_state_slot
        self.state_slots = (None if spare_state_slot is None else
                            torch.full((top,), spare_state_slot, dtype=torch.int64, device=device))
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph | _EagerTwin, torch.Tensor | None,
                                      list]] = {}
        self.capture_s = 0.0
        self.replays = self.fold_replays = 0
        self._runs = None if not runs else RunsBuffers(top, device)
        # the verify set's folds: ``fold(logged, runs)`` over a rung's logged rows, one graph a
        # rung, over a grid of 2 b runs (a kept prefix a run, every other row a run alone)
        self._fold = fold if runs else None
        self._fold_runs = None if self._fold is None else RunsBuffers(2 * top, device)
        self._folds: dict[int, torch.cuda.CUDAGraph | _EagerTwin] = {}
        self.last_runs: StateRuns | None = None  # the runs the last replay ran
        self.last_rung = 0
        self._logged: list = []  # the last replay's logged rows (a fold reads them)

    def _state_runs(self, b: int) -> StateRuns | None:
        """Rung ``b``'s runs: the static buffers (the truth at replay) behind placeholders,
        every row a held one-row run on the spare slot (``load_placeholders`` puts them in
        the buffers for the warm-up and the capture)."""
        if self._runs is None:
            return None
        return StateRuns(tuple(range(b + 1)), np.full(b, self.spare_state_slot),
                         np.ones(b, dtype=bool), tuple(range(b)), self._runs.views(b))

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:b], query_start_loc=tuple(range(b + 1)),
            seq_lens=(1,) * b, block_tables=self.block_tables[:b], block_size=self.block_size,
            seq_lens_t=self.seq_lens[:b],
            state_slots=None if self.state_slots is None else self.state_slots[:b],
            state_runs=self._state_runs(b))

    @torch.inference_mode()
    def capture(self, eager_twins: bool = False) -> None:
        """Capture every rung, largest first (smaller ones reuse its memory pool). Each rung
        runs twice eagerly first, on padding only (slot -1: no KV is written), so every Triton
        kernel is compiled before capture. ``eager_twins`` (CPU tests): capture nothing; a
        replay calls what the graph would have captured, over the same static buffers."""
        if eager_twins:
            for b in self.rungs:
                self._graphs[b] = (_EagerTwin(self._twin_forward(b)), None, [])
                if self._fold is not None:
                    self._folds[b] = _EagerTwin(self._twin_fold(b))
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        for b in sorted(self.rungs, reverse=True):
            self.load_placeholders(b)
            ids, pos = self.input_ids[:b], self.positions[:b]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.forward(ids, pos, self._meta(b))
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            meta = self._meta(b)
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(ids, pos, meta)
            runs = meta.state_runs
            self._graphs[b] = (graph, out, [] if runs is None else runs.log)
            if self._fold is not None:
                self._folds[b] = self._capture_fold(b, runs.log, pool)
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d %s CUDA graphs (rungs %s) in %.1f s", len(self._graphs),
                 "verify" if self._runs is not None else "decode", self.rungs, self.capture_s)

    def _twin_forward(self, b: int) -> Callable[[], tuple[torch.Tensor, list]]:
        def forward() -> tuple[torch.Tensor, list]:
            meta = self._meta(b)
            out = self.forward(self.input_ids[:b], self.positions[:b], meta)
            return out, [] if meta.state_runs is None else meta.state_runs.log
        return forward

    def _twin_fold(self, b: int) -> Callable[[], None]:
        return lambda: self._fold(self._logged, self._fold_placeholders(b))

    def _fold_placeholders(self, b: int) -> StateRuns:
        """Rung ``b``'s fold runs: the static buffers (the truth) behind held one-row runs."""
        g = 2 * b
        return StateRuns(tuple(range(b + 1)) + (b,) * (g - b),
                         np.full(g, self.spare_state_slot), np.ones(g, dtype=bool),
                         tuple(range(g)), self._fold_runs.views(g))

    def load_placeholders(self, b: int) -> None:
        """Rung ``b``'s placeholder runs into the static buffers, as its warm-up and capture
        read them: a verify's b rows each a held one-row run, a fold's grid of 2b runs those
        b runs then b empty ones (the grid covers exactly the b logged rows)."""
        if self._runs is not None:
            self._runs.load(self._state_runs(b))
        if self._fold_runs is not None:
            self._fold_runs.load(self._fold_placeholders(b))

    def _capture_fold(self, b: int, logged: list, pool) -> torch.cuda.CUDAGraph:
        """Rung ``b``'s fold over its verify graph's logged rows, placeholders held (twice
        eagerly first: nothing is read or written)."""
        runs = functools.partial(self._fold_placeholders, b)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._fold(logged, runs())
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._fold(logged, runs())
        return graph

    def replay_fold(self, fold: StateRuns) -> bool:
        """After a replay of this verify set: fold the accepted prefixes from its logged rows,
        ``fold`` over them from row 0 (``gated_deltanet.fold_runs(..., singles=True)``).
        False when the rung has no fold graph (the caller folds eagerly)."""
        b = self.last_rung
        graph = self._folds.get(b)
        if graph is None:
            return False
        self._fold_runs.load(fold.padded(b, 2 * b, self.spare_state_slot))
        graph.replay()
        self.fold_replays += 1
        return True

    def covers_rows(self, n: int) -> bool:
        """A decode step of ``n`` rows has a graph."""
        return 0 < n <= self.max_rows and graph_batch(n) in self._graphs

    def run(self, inp: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the step's rung on its inputs (``input_ids``: [n] int64 on the device instead
        of ``inp.input_ids``, e.g. the tokens just sampled). Returns hidden [n, H] (a view of
        the graph's output buffer: valid until the next replay)."""
        n = inp.rows.num_decode
        b = graph_batch(n)
        graph, out, logged = self._graphs[b]
        meta = inp.meta
        runs = meta.state_runs
        if self._runs is not None:
            if runs.cu[-1] != n:
                raise ValueError(f"verify graph: runs over {runs.cu[-1]} rows, the step has {n}")
            self._runs.load(runs.padded(b, b, self.spare_state_slot))
            self.last_rung, self.last_runs = b, runs
        self.input_ids[:n].copy_(inp.input_ids if input_ids is None else input_ids,
                                 non_blocking=True)
        self.positions[:n].copy_(inp.positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        w = meta.block_tables.shape[1]
        self.block_tables[:n, :w].copy_(meta.block_tables, non_blocking=True)
        lens = meta.seq_lens_t
        if lens is None:
            lens = torch.frombuffer(array.array("i", meta.seq_lens), dtype=torch.int32)
        self.seq_lens[:n].copy_(lens, non_blocking=True)
        if self.state_slots is not None:
            self.state_slots[:n].copy_(meta.state_slots, non_blocking=True)
        if b > n:  # padding: no KV write, one harmless KV read (and the spare state slot)
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            if self.state_slots is not None:
                self.state_slots[n:b].fill_(self.spare_state_slot)
        if isinstance(graph, _EagerTwin):
            out, logged = graph.replay()
        else:
            graph.replay()
        if self._runs is not None:
            runs.log[:] = self._logged = logged
        self.replays += 1
        return out[:n]


class _EagerTwin:
    """What a captured graph replays, called eagerly over the same static buffers (CPU tests:
    ``DecodeGraphs.capture(eager_twins=True)``)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def replay(self):
        return self.fn()


class RunsBuffers:
    """A graph set's static ``StateRuns`` tensors for up to ``top`` runs (one device buffer,
    one pinned host twin: a step's runs are one copy), sections 16-byte aligned as
    ``StateRuns.tensors`` lays them out; a graph of a grid of ``b`` runs reads ``views(b)``."""

    def __init__(self, top: int, device: torch.device):
        self.at = at = [0]
        for size in (8 * top, 4 * (top + 1), top):
            at.append(-(-(at[-1] + size) // 16) * 16)
        words = -(-(at[3] + top) // 8)
        cuda = device.type == "cuda"
        self.host = torch.zeros(8 * words, dtype=torch.uint8, pin_memory=cuda)
        self.dev = torch.empty(8 * words, dtype=torch.uint8, device=device)
        self.copied = torch.cuda.Event() if cuda else None
        h = self.host.numpy()
        self.slots = h[:8 * top].view(np.int64)
        self.cu = h[at[1]:at[1] + 4 * (top + 1)].view(np.int32)
        self.fresh, self.hold = h[at[2]:at[2] + top], h[at[3]:at[3] + top]
        self.slots[:], self.cu[:], self.fresh[:], self.hold[:] = 0, np.arange(top + 1), 1, 1
        self.dev.copy_(self.host)

    def views(self, b: int) -> tuple[torch.Tensor, ...]:
        d, at = self.dev, self.at
        return (d[:8 * b].view(torch.int64), d[at[1]:at[1] + 4 * (b + 1)].view(torch.int32),
                d[at[2]:at[2] + b].view(torch.bool), d[at[3]:at[3] + b].view(torch.bool))

    def load(self, runs: StateRuns) -> None:
        """``runs`` (a graph's whole grid: ``StateRuns.padded``) into ``views(runs.num_runs)``."""
        b = runs.num_runs
        if self.copied is not None:
            self.copied.synchronize()  # the last load's copy has run
        self.slots[:b], self.cu[:b + 1], self.fresh[:b] = runs.slots, runs.cu, runs.fresh
        self.hold[:b] = 0
        self.hold[list(runs.hold)] = 1
        end = self.at[3] + b
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
