"""The rank Runner: implements the Model traits on torch for one rank (CPU, or CUDA by choice).

Owns the model weights, the paged KV cache tensors and the device block tables; as the Model of
one rank it also keeps its KV book (``worker.kv_book``: pool, slots, the lifecycle methods),
whose new blocks it copies into the block tables. Invariants:
a sequence's KV is written only through slots its block table holds; ``seq.seq_len`` counts
positions whose KV is written and ``seq.tokens`` their ids; blocks are reserved by the
scheduler (``reserve_blocks``) before a step, so a forward never allocates.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from epserve.kernels.attention import AttentionMetadata
from epserve.models.loader import load_model
from epserve.models.parallel import ParallelInfo
from epserve.models.traits import (
    BeamReq, CapabilityAbsent, ForwardDisclosure, MixedBatchResult, PrefillSlice,
    SampledToken, SequenceState,
)
from epserve.worker.batch import BlockTables, StepInputs, StepRow, build_step_inputs
from epserve.worker.cuda_graphs import DecodeGraphs
from epserve.worker.forward_forms import ForwardForms
from epserve.worker.kv_book import KvBook, KvLifecycle
from epserve.worker.lookahead import DecodeLookahead
from epserve.worker.runner_config import (  # noqa: F401 (re-exported)
    RunnerConfig, resolve_device, resolve_dtype,
)
from epserve.worker.sampler import launch_sample, prompt_logprobs_rows
from epserve.worker.warmup import warm_up_prefill

log = logging.getLogger(__name__)

class Runner(ForwardForms, KvLifecycle):
    """Implements ``models.traits.Model`` for one rank (EP over ranks comes on top of it)."""

    def __init__(self, cfg: RunnerConfig, parallel: ParallelInfo = ParallelInfo()):
        from epserve.models.config import ModelConfig

        if cfg.decode_lookahead and parallel.world_size > 1:  # a lone forward hangs the group
            raise ValueError("decode_lookahead is single-rank only: an EP rank's forward runs "
                             "in lockstep with the other ranks' (use ep_size=1)")
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
        self.num_blocks = cfg.num_kv_blocks or self._blocks_from_bytes(self._kv_budget())
        shape = (self.num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(mc.num_layers)]
        self.tables = BlockTables(cfg.max_num_seqs, -(-self.max_model_len // self.block_size))
        # one rank is its own Model and keeps its KV book; an EP rank's is the leader's
        self.book: KvBook | None = None
        if parallel.world_size == 1:
            self.book = KvBook(1, self.num_blocks, self.block_size, cfg.max_num_seqs,
                               self.max_model_len, cfg.enable_prefix_caching,
                               on_blocks=self._blocks_gained)
            self.pool = self.book.pools[0]  # its one pool (read by tests and stats)
        if self.device.type == "cuda" and parallel.world_size == 1 and cfg.warmup_tokens > 0:
            t0 = time.perf_counter()
            warm_up_prefill(self._forward, self.model.compute_logits, cfg.warmup_tokens,
                            self.max_model_len, self.block_size, self.device)
            log.info("prefill warm-up (%d tokens) in %.1f s", cfg.warmup_tokens,
                     time.perf_counter() - t0)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not cfg.enforce_eager and parallel.world_size == 1:
            self.graphs = DecodeGraphs(self._forward, self.device, self.block_size,
                                       cfg.max_num_seqs, self.tables.max_blocks_per_seq)
            self.graphs.capture()
        self.lookahead: DecodeLookahead | None = None
        lookahead = cfg.decode_lookahead
        if lookahead or (lookahead is None and self.graphs is not None):
            self.lookahead = DecodeLookahead(self._forward, self.graphs, self.tables,
                                             self.block_size, self.device, self.max_model_len,
                                             lambda seq, n: self.reserve_blocks(seq, n))

    def _blocks_gained(self, seq: SequenceState, first: int, blocks: Sequence[int]) -> None:
        self.tables.set_blocks(seq.slot_idx, first, blocks)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _kv_budget(self) -> int:
        """Bytes for the KV cache when ``num_kv_blocks`` is not given."""
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

    def _blocks_from_bytes(self, budget: int) -> int:
        mc = self.model_config
        per_block = (2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim
                     * torch.finfo(self.dtype).bits // 8)
        return max(2, budget // per_block)

    # ------------------------------------------------------------------ capabilities

    def capabilities(self) -> frozenset[str]:
        return frozenset({"forward", "lifecycle", "logits", "streams", "circuit"})

    def forward_disclosure(self) -> ForwardDisclosure:
        return ForwardDisclosure()

    # ------------------------------------------------------------------ lifecycle

    def teardown(self) -> None:
        self.kv_caches = []

    def bind_gpu_to_thread(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # ------------------------------------------------------------------ forward

    def kv_block_size(self) -> int | None:
        return self.block_size

    def is_mla(self) -> bool:
        return False

    def hc_mult(self) -> int:
        return 0

    def supports_beam(self) -> bool:
        return False

    def generate_beam_batch(self, reqs: Sequence[BeamReq]) -> list[list[int]]:
        raise CapabilityAbsent("beam search is not implemented by this runner")

    def is_ep(self) -> bool:
        return False

    def ep_worker_step(self) -> bool:
        raise CapabilityAbsent("ep_worker_step: this runner is a single rank (ep_size=1)")

    def ep_keep_alive(self) -> None:
        """One rank waits on no collective: nothing to keep alive."""

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mixed_forward_batch(self, decode_tokens: Sequence[int],
                            decode_seqs: Sequence[SequenceState],
                            prefill_slices: Sequence[PrefillSlice]) -> MixedBatchResult:
        """One forward over every decode row and every prefill chunk; samples each decode row
        and each last chunk with its sequence's ``RowSampling``."""
        if self.lookahead is not None and not prefill_slices and decode_seqs \
                and len(decode_tokens) == len(decode_seqs):
            hidden = self.lookahead.take(decode_tokens, decode_seqs)
            if hidden is not None:  # this step's forward ran ahead, during the host's work
                return self._sample_step(decode_tokens, decode_seqs, (), (), hidden)
        inp = self.prepare_step(decode_tokens, decode_seqs, prefill_slices)
        if inp is None:
            return MixedBatchResult(decode=(), prefill=())
        return self.execute_step(inp)

    def prepare_step(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                     prefill_slices: Sequence[PrefillSlice]) -> StepInputs | None:
        """The host side of a step: validate rows and build the flattened inputs."""
        if len(decode_tokens) != len(decode_seqs):
            raise ValueError(f"{len(decode_tokens)} decode tokens for {len(decode_seqs)} sequences")
        rows = [self._prefill_row(sl) for sl in prefill_slices]
        if not rows and not decode_seqs:
            return None
        return build_step_inputs(decode_tokens, decode_seqs, rows, self.tables,
                                 self.block_size, self.device)

    def _prefill_row(self, sl: PrefillSlice) -> StepRow:
        seq = sl.seq
        if sl.chunk_start != seq.seq_len:
            raise ValueError(f"prefill chunk starts at {sl.chunk_start} but the sequence has "
                             f"KV for {seq.seq_len} tokens")
        end = sl.chunk_start + sl.chunk_len
        if sl.chunk_len <= 0 or end > len(sl.prompt_tokens):
            raise ValueError(f"prefill chunk [{sl.chunk_start}, {end}) outside a prompt of "
                             f"{len(sl.prompt_tokens)} tokens")
        if sl.is_last_chunk and end != len(sl.prompt_tokens):
            raise ValueError("is_last_chunk set on a chunk that does not end the prompt")
        targets: tuple[int, ...] = ()
        if seq.collect_prompt_logprobs is not None:
            plen = seq.prompt_len or len(sl.prompt_tokens)
            targets = tuple(sl.prompt_tokens[i + 1] if i + 1 < plen else -1
                            for i in range(sl.chunk_start, end))
        return StepRow(seq, sl.prompt_tokens[sl.chunk_start:end], sl.chunk_start,
                       sl.is_last_chunk, targets)

    @torch.inference_mode()
    def execute_step(self, inp: StepInputs) -> MixedBatchResult:
        """The device side: forward, prompt logprobs, sampling; advances each row's KV."""
        if self.lookahead is not None:
            self.lookahead.discard()
        if self.graphs is not None and self.graphs.covers(inp):
            hidden = self.graphs.run(inp)  # [n, H]
        else:
            hidden = self._forward(inp.input_ids, inp.positions, inp.meta)  # [T, H]
        nd = len(inp.decode_seqs)
        self._collect_prompt_logprobs(inp.prefill_rows, hidden, inp.meta.query_start_loc[nd:])
        if inp.prefill_rows:  # a pure decode step samples every row, in order
            hidden = hidden[inp.sample_index]
        return self._sample_step(inp.decode_tokens, inp.decode_seqs, inp.prefill_rows,
                                 inp.sampled_prefill, hidden)

    @torch.inference_mode()
    def _sample_step(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                     prefill_rows: Sequence[StepRow], sampled_prefill: Sequence[int],
                     hidden: torch.Tensor) -> MixedBatchResult:
        """Advance each row's KV bookkeeping past the step, then sample ``hidden`` [R, H] (one
        row per sampled position: the decode rows, then the sampled prefill rows); queues the
        lookahead forward of a pure decode step before reading the tokens back."""
        for tok, seq in zip(decode_tokens, decode_seqs):
            seq.tokens.append(tok)
            seq.seq_len += 1
            seq.kv_valid_tokens = seq.seq_len
        for row in prefill_rows:
            row.seq.tokens.extend(row.tokens)
            row.seq.seq_len = row.seq.kv_valid_tokens = row.start + len(row.tokens)
        nd = len(decode_seqs)
        seqs = list(decode_seqs) + [prefill_rows[r].seq for r in sampled_prefill]
        prefill: list[SampledToken | None] = [None] * len(prefill_rows)
        if not seqs:
            return MixedBatchResult(decode=(), prefill=tuple(prefill))
        logits = self.model.compute_logits(hidden)  # [R, V] float32
        pending = launch_sample(logits, [s.sampling for s in seqs],
                                [s.output_index for s in seqs])
        ahead = (self.lookahead is not None and not prefill_rows
                 and self.lookahead.launch(decode_seqs, pending))
        tokens = pending.result()
        if ahead:
            self.lookahead.fed([t.token_id for t in tokens])
        for r, tok in zip(sampled_prefill, tokens[nd:]):
            prefill[r] = tok
        return MixedBatchResult(decode=tuple(tokens[:nd]), prefill=tuple(prefill),
                                decode_logits=logits[:nd] if nd else None,
                                prefill_logits=logits[nd:] if len(seqs) > nd else None)

    def _collect_prompt_logprobs(self, rows: Sequence[StepRow], hidden: torch.Tensor,
                                 qsl: Sequence[int]) -> None:
        """Score each collecting row's prompt positions; ``qsl``: the rows' starts in hidden."""
        for r, row in enumerate(rows):
            if not row.prompt_targets:
                continue
            scored = [i for i, t in enumerate(row.prompt_targets) if t >= 0]
            if not scored:
                continue
            h = hidden[qsl[r]:qsl[r + 1]][torch.tensor(scored)]
            logits = self.model.compute_logits(h)  # [P, V] float32
            targets = [row.prompt_targets[i] for i in scored]
            row.seq.prompt_logprobs.extend(
                prompt_logprobs_rows(logits, targets, row.seq.collect_prompt_logprobs or 0))

    # ------------------------------------------------------------------ logits

    def vocab_size(self) -> int:
        return self.model_config.vocab_size
