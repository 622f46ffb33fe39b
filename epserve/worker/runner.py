"""The rank Runner: one rank's device side of a step, on torch (CPU, or CUDA by choice).

Owns the model weights (this rank's expert shard), the paged KV cache tensors, the host block
tables the rank's commands fill, the decode CUDA graphs and the decode lookahead. It is not a
``Model``: ``worker.step_model.StepModel`` is, for every ``ep_size``, and each rank's
``worker.rank_executor.RankExecutor`` hands this Runner its rows. Invariants: a row's KV is
written only through slots its block table holds (the rank's validator refused any other
command); a forward never allocates KV blocks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from epserve.kernels.attention import AttentionMetadata
from epserve.kernels.token_mask import apply_token_masks
from epserve.models.config import CheckpointError
from epserve.models.gated_deltanet import fold_runs
from epserve.models.layer_cache import KvCacheSpec, StateCacheSpec, allocate_states
from epserve.models.loader import load_model
from epserve.models.mtp import load_mtp_head
from epserve.models.parallel import ParallelInfo
from epserve.models.traits import DECODE_BATCH_LADDER, PromptTokenLogprob, SampledToken
from epserve.worker.batch import BlockTables, RankRows, StepInputs, build_step_inputs
from epserve.worker.cuda_graphs import DecodeGraphs
from epserve.worker.lookahead import DecodeLookahead
from epserve.worker.mtp_drafter import MtpDrafter
from epserve.worker.runner_config import (  # noqa: F401 (re-exported)
    RunnerConfig, resolve_device, resolve_dtype,
)
from epserve.worker.sampler import launch_sample, prompt_logprobs_rows
from epserve.worker.step_buffers import StepBuffers
from epserve.worker.warmup import warm_up_prefill, warm_up_sampling, warmup_token_counts

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankOutput:
    """One step's output on one rank: a token per sampled row (decode rows, then the sampled
    prefill rows), each collecting prefill row's scored prompt positions by slot, and the
    sampled rows' logits [R, V] float32 (on the device)."""

    tokens: list[SampledToken]
    prompt_logprobs: dict[int, list[PromptTokenLogprob]]
    logits: torch.Tensor | None


class Runner:
    """One rank's weights, KV cache and device work."""

    def __init__(self, cfg: RunnerConfig, parallel: ParallelInfo = ParallelInfo()):
        from epserve.models.config import ModelConfig

        if cfg.decode_lookahead and parallel.world_size > 1:  # a lone forward hangs the group
            raise ValueError("decode_lookahead is single-rank only: an EP rank's forward runs "
                             "in lockstep with the other ranks' (use ep_size=1)")
        if cfg.decode_lookahead and cfg.mtp_drafts:  # its forward would overwrite what the
            raise ValueError("decode_lookahead does not combine with speculative_config "  # head
                             "method 'mtp': the MTP head reads each step's hidden states, "
                             "which a forward queued ahead overwrites")
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        hf_dtype = ModelConfig.from_pretrained(cfg.model).torch_dtype
        self.dtype = resolve_dtype(cfg.dtype, hf_dtype, self.device)
        torch.manual_seed(cfg.seed)
        self.model, self.model_config = load_model(
            cfg.model, dtype=self.dtype, device=self.device, parallel=parallel,
            load_format=cfg.load_format)
        mc = self.model_config
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        self.block_size = cfg.block_size
        specs = self.model.layer_cache_specs()
        self.mtp_head = None if not cfg.mtp_drafts else self._mtp_head(parallel)
        mtp_specs = () if self.mtp_head is None else self.mtp_head.layer_cache_specs()
        kv_specs = [c for c in (*specs, *mtp_specs) if isinstance(c, KvCacheSpec)]
        state_specs = [c for c in specs if isinstance(c, StateCacheSpec)]
        # recurrent state: one slot per sequence slot, plus the spare one padded rows use
        self.spare_state_slot = cfg.max_num_seqs if state_specs else None
        state_bytes = (cfg.max_num_seqs + 1) * sum(c.bytes_per_slot() for c in state_specs)
        per_block = self.block_size * sum(c.bytes_per_token(self.dtype) for c in kv_specs)
        self.num_blocks = cfg.num_kv_blocks or self._blocks_from_bytes(
            self._kv_budget() - state_bytes, per_block)
        # the states of every linear-attention layer: one tensor per kind, slots on dim 1
        states, self.state_pools = allocate_states(state_specs, cfg.max_num_seqs + 1,
                                                   self.device)
        next_state = iter(states)
        self.kv_caches = [next(next_state) if isinstance(c, StateCacheSpec) else self._cache(c)
                          for c in specs]
        self.tables = BlockTables(cfg.max_num_seqs, -(-self.max_model_len // self.block_size))
        self.mtp: MtpDrafter | None = None
        if self.mtp_head is not None:
            self.mtp = MtpDrafter(self.mtp_head, [self._cache(c) for c in mtp_specs],
                                  self.model.rope, self.tables, self.block_size, self.device,
                                  cfg.mtp_drafts, parallel.world_size)
        self._hidden: torch.Tensor | None = None  # the last step's rows (the MTP head reads)
        # a prefix hit would need the recurrent state at the prefix: no snapshots are kept
        self.prefix_caching = cfg.enable_prefix_caching and not state_specs
        if cfg.enable_prefix_caching and state_specs:
            log.info("prefix caching is off: this model keeps recurrent state (gated DeltaNet) "
                     "and no state snapshots at block boundaries")
        if self.device.type == "cuda" and parallel.world_size == 1 and cfg.warmup_tokens > 0:
            self.warm_up()
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not cfg.enforce_eager and parallel.world_size == 1:
            self.graphs = DecodeGraphs(self._forward, self.device, self.block_size,
                                       cfg.max_num_seqs, self.tables.max_blocks_per_seq,
                                       self.spare_state_slot)
            self.graphs.capture()
        self.verify_graphs: DecodeGraphs | None = None  # a recurrent model's verify steps
        if self.graphs is not None and self.spare_state_slot is not None and \
                cfg.speculative_tokens:
            self.verify_graphs = DecodeGraphs(
                self._forward, self.device, self.block_size,
                min(DECODE_BATCH_LADDER[-1], cfg.max_num_seqs * (cfg.speculative_tokens + 1)),
                self.tables.max_blocks_per_seq, self.spare_state_slot, runs=True,
                fold=lambda logged, runs: self.model.fold_logged(self.kv_caches, logged, runs,
                                                                 0))
            self.verify_graphs.capture()
        if self.mtp is not None and self.graphs is not None:  # the head's passes
            self.mtp.capture_graphs(min(DECODE_BATCH_LADDER[-1],
                                        cfg.max_num_seqs * (cfg.mtp_drafts + 1)))
        self.buffers = StepBuffers(self.device)  # the step inputs' memory, reused
        self.lookahead: DecodeLookahead | None = None
        lookahead = cfg.decode_lookahead
        # with recurrent state too: the rows' states are copied aside (one launch per state
        # tensor, ~30 us of HBM a row at the 35B-A3B shape) to hide ~0.6 ms of host work; not
        # with an MTP head, which reads the step's hidden states after a queued forward
        if lookahead or (lookahead is None and self.graphs is not None and self.mtp is None):
            self.lookahead = DecodeLookahead(self._forward, self.graphs, self.tables,
                                             self.block_size, self.device, self.max_model_len,
                                             state_pools=self.state_pools, buffers=self.buffers)
        self._ready: torch.Tensor | None = None  # the lookahead's hidden states for this step

    def warm_up(self) -> None:
        """Compile what steps of up to ``cfg.warmup_tokens`` tokens launch (``worker.warmup``):
        a prefill forward of each step size class, the largest first, then sampling. Nothing is
        written to the KV cache. (At start on CUDA with one rank; the decode graphs' capture
        compiles the decode sizes.)"""
        t0 = time.perf_counter()
        sizes = warmup_token_counts(self.model, self.cfg.warmup_tokens)
        for n in sizes:
            hidden = warm_up_prefill(self._forward, self.model.compute_logits, n,
                                     self.max_model_len, self.block_size, self.device,
                                     self.spare_state_slot)
            if n == sizes[0]:  # the full step's rows: both kinds of sampled row
                warm_up_sampling(self.model.compute_logits(hidden[:4]))
        log.info("warm-up: prefill forwards of %s tokens and sampling in %.1f s", sizes,
                 time.perf_counter() - t0)

    def _mtp_head(self, parallel: ParallelInfo):
        """The checkpoint's MTP head (``mtp_drafts``); ``ValueError`` naming the method when
        the checkpoint has none."""
        try:
            return load_mtp_head(self.cfg.model, self.model_config, self.model, dtype=self.dtype,
                                 device=self.device, parallel=parallel,
                                 load_format=self.cfg.load_format)
        except CheckpointError as exc:
            raise ValueError(f"speculative_config.method='mtp': {exc}") from None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _cache(self, spec: KvCacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """One full-attention layer's paged K and V."""
        shape = (self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        return (torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device))

    def _kv_budget(self) -> int:
        """Bytes for the KV cache (and recurrent states) when ``num_kv_blocks`` is not
        given."""
        if self.device.type != "cuda":
            return self.cfg.kv_cache_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free  # weights, this process's other tensors, other processes
        budget = int(total * self.cfg.gpu_memory_utilization) - used \
            - self.cfg.activation_reserve_bytes
        if budget <= 0:
            raise ValueError(f"gpu_memory_utilization={self.cfg.gpu_memory_utilization}: the "
                             f"weights leave no room for a KV cache ({used / 2**30:.1f} GiB of "
                             f"{total / 2**30:.1f} GiB in use)")
        return budget

    def _blocks_from_bytes(self, budget: int, per_block: int) -> int:
        if budget <= 0:
            raise ValueError(f"the recurrent states of max_num_seqs={self.cfg.max_num_seqs} "
                             f"sequences leave no memory for a KV cache; lower max_num_seqs")
        return max(2, budget // max(per_block, 1))


    # ------------------------------------------------------------------ one step

    def prepare(self, rows: RankRows) -> StepInputs | None:
        """The host side of a step: its flattened inputs, or None when the lookahead forward
        queued during the last step is exactly this step's (its hidden states are kept)."""
        if self.lookahead is not None:
            self._ready = self.lookahead.take(rows)
            if self._ready is not None:
                return None
        return build_step_inputs(rows, self.tables, self.block_size, self.device,
                                 self.spare_state_slot is not None, self.buffers)

    @torch.inference_mode()
    def execute(self, rows: RankRows, inp: StepInputs | None, ahead: bool = False,
                nblocks: np.ndarray | None = None) -> RankOutput:
        """The device side: forward (or the lookahead's), prompt logprobs, sampling. ``ahead``
        (a pure decode step whose rows' next step is likely; ``nblocks``: each decode row's
        block count): queue that next step's forward before reading the tokens back."""
        hidden, self._ready = self._ready, None
        plps: dict[int, list[PromptTokenLogprob]] = {}
        if hidden is None:
            assert inp is not None
            graphs = self.graphs if inp.meta.state_runs is None else self.verify_graphs
            if graphs is not None and not rows.chunked and graphs.covers_rows(rows.num_decode):
                hidden = graphs.run(inp)  # [n, H]
            else:
                hidden = self._forward(inp.input_ids, inp.positions, inp.meta)  # [T, H]
            self._hidden = hidden if self.mtp is not None else None
            if rows.chunked:
                if rows.prefill:
                    plps = self._prompt_logprobs(rows, hidden, inp.meta.query_start_loc)
                hidden = hidden[inp.sample_index]
        if not rows.sampling:
            return RankOutput([], plps, None)
        logits = self.model.compute_logits(hidden)  # [R, V] float32
        if rows.mask_rows is not None:  # constrained rows: only their allowed tokens
            apply_token_masks(logits, rows.mask_rows, rows.mask_words)
        pending = launch_sample(logits, rows.sampling, rows.output_index, rows.penalties)
        launched = (ahead and self.lookahead is not None and nblocks is not None
                    and self.lookahead.launch(rows, nblocks, pending))
        tokens = pending.result()
        if launched:
            self.lookahead.fed(np.array([t.token_id for t in tokens], dtype=np.int64))
        return RankOutput(tokens, plps, logits)

    def _prompt_logprobs(self, rows: RankRows, hidden: torch.Tensor,
                         qsl: tuple[int, ...]) -> dict[int, list[PromptTokenLogprob]]:
        """Score each collecting prefill row's prompt positions; ``qsl``: row starts in hidden."""
        out: dict[int, list[PromptTokenLogprob]] = {}
        nd = rows.first_prefill_seq
        for r, want in enumerate(rows.prompt_logprobs):
            if want is None:
                continue
            k, targets = want
            scored = [i for i, t in enumerate(targets) if t >= 0]
            if not scored:
                continue
            h = hidden[qsl[nd + r]:qsl[nd + r + 1]][torch.tensor(scored)]
            logits = self.model.compute_logits(h)  # [P, V] float32
            out[rows.prefill[r].slot] = prompt_logprobs_rows(
                logits, [targets[i] for i in scored], k)
        return out

    @torch.inference_mode()
    def fold_verified(self, inp: StepInputs, kept: list[int]) -> None:
        """After a step with a recurrent model's verify rows (their states held): advance
        each row's states by its first ``kept[i]`` tokens, the fed token and the accepted
        drafts (``ModelSsmState``'s rollback to, and commit of, the accepted prefix)."""
        runs, graphs = inp.meta.state_runs, self.verify_graphs
        if graphs is not None and runs is not None and graphs.last_runs is runs and \
                graphs.replay_fold(fold_runs(runs, kept, singles=True)[0]):
            return  # this step's verify replayed a graph: its fold does too
        self.model.fold_held_states(self.kv_caches, inp.meta, kept)

    def propose_drafts(self, rows: RankRows | None, inp: StepInputs | None,
                       tokens: list[SampledToken], kept: list[int],
                       nblocks: np.ndarray) -> dict[int, tuple[int, ...]]:
        """The MTP head's drafts for the step just run (``worker.mtp_drafter``), by slot."""
        hidden, self._hidden = self._hidden, None
        return self.mtp.propose(rows, inp, hidden, tokens, kept, nblocks)

    @torch.inference_mode()
    def empty_forward(self) -> None:
        """Zero rows: run the layers anyway, so an EP rank joins every MoE collective."""
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(slot_mapping=empty, query_start_loc=(0,), seq_lens=(),
                                 block_tables=torch.zeros((0, 1), dtype=torch.int32,
                                                          device=self.device),
                                 block_size=self.block_size,
                                 state_slots=None if self.spare_state_slot is None else empty)
        self.model(empty, empty, self.kv_caches, meta)

    # ------------------------------------------------------------------ facts and lifecycle

    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def teardown(self) -> None:
        self.kv_caches = []

    def bind_gpu_to_thread(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
