"""EpRank: one rank's side of an EP step — decode, validate, apply, run its rows, report.

Every rank, the leader's rank 0 included, runs the same ``step`` on the same frame, so every
rank reaches the same verdict before any collective. Invariants: an invalid command raises
``EpCommandFailed`` on every rank and changes nothing; preparation that could fail on one rank
only ends in an agreement all-reduce, so all raise or none does; a rank with no rows still
runs the forward (zero rows) and so joins every MoE collective.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from epserve.kernels.attention import AttentionMetadata
from epserve.models.traits import EpCommandFailed, SequenceState
from epserve.worker.batch import StepInputs, StepRow, build_step_inputs
from epserve.worker.ep_results import RankResult, encode_result
from epserve.worker.ep_mirror import EpMirror
from epserve.worker.step_command import (
    FEED_DEVICE, KIND_SHUTDOWN, ProtocolError, StepCommand, WireLimits, decode,
)
from epserve.worker.runner import Runner

log = logging.getLogger(__name__)


class EpRank:
    """Executes this rank's rows of each command on its Runner (model, KV, slot tables)."""

    def __init__(self, runner: Runner, comm: Any, rank: int, world_size: int):
        self.runner = runner
        self.comm = comm
        self.rank = rank
        self.mirror = EpMirror(world_size, runner.num_blocks, runner.block_size,
                               runner.cfg.max_num_seqs, runner.tables.max_blocks_per_seq,
                               runner.model_config.vocab_size)
        # what a correct leader never exceeds: a frame beyond it is refused before any row
        # is built (bounds the work a hostile or corrupt frame can cause)
        self.limits = WireLimits(world_size, runner.cfg.max_num_seqs,
                                 runner.tables.max_blocks_per_seq)
        self.local: dict[int, SequenceState] = {}
        self.last_token: dict[int, int] = {}
        self.failures: list[EpCommandFailed] = []
        self.last_applied = -1

    # ------------------------------------------------------------------ one step

    def step(self, frame: bytes) -> bytes | None:
        """Run one command; the encoded ``RankResult``, or None for shutdown. Raises
        ``ProtocolError`` (broken channel) or ``EpCommandFailed`` (same on every rank)."""
        cmd = decode(frame, self.limits)
        self.mirror.validate(cmd)
        if cmd.kind == KIND_SHUTDOWN:
            return None
        self.mirror.apply(cmd)
        self.last_applied = cmd.step_id
        self._apply_local(cmd)
        err = None
        try:
            inp, plp_before = self._prepare(cmd)
        except Exception as exc:  # e.g. an allocation on this rank only: agree first
            err, inp, plp_before = exc, None, {}
        if not self.comm.all_agree(err is None):
            if err is not None:
                log.error("rank %d: preparing step %d failed: %s", self.rank, cmd.step_id, err)
            reason = (f"preparation failed on rank {self.rank} ({type(err).__name__})" if err
                      else "preparation failed on another rank")
            raise EpCommandFailed(cmd.step_id, reason)
        return encode_result(self._execute(cmd, inp, plp_before))

    def _apply_local(self, cmd: StepCommand) -> None:
        tables = self.runner.tables
        for r in cmd.releases:
            if r.rank == self.rank:
                self.local.pop(r.slot, None)
                self.last_token.pop(r.slot, None)
        for n in cmd.new_seqs:
            if n.rank == self.rank:
                self.local[n.slot] = SequenceState(
                    slot_idx=n.slot, rank=n.rank, seq_len=n.seq_len, prompt_len=n.prompt_len,
                    collect_prompt_logprobs=None if n.prompt_logprobs < 0 else n.prompt_logprobs,
                    sampling=n.sampling)
        for u in cmd.sampling_updates:
            if u.rank == self.rank:
                self.local[u.slot].sampling = u.sampling
        for b in cmd.block_updates:
            if b.rank == self.rank:
                tables.set_blocks(b.slot, b.first, b.blocks)
                self.local[b.slot].block_table.extend(b.blocks)

    def _prepare(self, cmd: StepCommand) -> tuple[StepInputs | None, dict[int, int]]:
        me = self.rank
        dseqs, dtoks = [], []
        rank, slot, feed, oidx = cmd.decode.cols
        mine = (rank == me).nonzero()[0]
        local, last = self.local, self.last_token
        for s, f, o in zip(slot[mine].tolist(), feed[mine].tolist(), oidx[mine].tolist()):
            seq = local[s]
            seq.output_index = o
            dseqs.append(seq)
            dtoks.append(last[s] if f == FEED_DEVICE else f)
        rows, plp_before = [], {}
        for p in cmd.prefill:
            if p.rank == me:
                seq = self.local[p.slot]
                seq.output_index = p.output_index
                rows.append(StepRow(seq, p.tokens, p.start, p.sample, self._targets(seq, p)))
                if seq.collect_prompt_logprobs is not None:
                    plp_before[p.slot] = len(seq.prompt_logprobs)
        if not dseqs and not rows:
            return None, {}
        r = self.runner
        return build_step_inputs(dtoks, dseqs, rows, r.tables, r.block_size, r.device), plp_before

    @staticmethod
    def _targets(seq: SequenceState, p) -> tuple[int, ...]:
        if seq.collect_prompt_logprobs is None:
            return ()
        nxt = list(p.tokens[1:]) + [p.next_token]
        return tuple(t if p.start + i + 1 < seq.prompt_len else -1 for i, t in enumerate(nxt))

    def _execute(self, cmd: StepCommand, inp: StepInputs | None,
                 plp_before: dict[int, int]) -> RankResult:
        if inp is None:
            self._empty_forward()
            return RankResult(cmd.step_id, self.rank, {}, {})
        res = self.runner.execute_step(inp)
        sampled = {seq.slot_idx: tok for seq, tok in zip(inp.decode_seqs, res.decode)}
        for row, tok in zip(inp.prefill_rows, res.prefill):
            if tok is not None:
                sampled[row.seq.slot_idx] = tok
        for slot, tok in sampled.items():
            self.last_token[slot] = tok.token_id
        plps = {slot: self.local[slot].prompt_logprobs[n:] for slot, n in plp_before.items()}
        return RankResult(cmd.step_id, self.rank, sampled, plps)

    @torch.inference_mode()
    def _empty_forward(self) -> None:
        """Zero rows: run the layers anyway so this rank joins every MoE collective."""
        r = self.runner
        empty = torch.empty(0, dtype=torch.int64, device=r.device)
        meta = AttentionMetadata(slot_mapping=empty, query_start_loc=(0,), seq_lens=(),
                                 block_tables=torch.zeros((0, 1), dtype=torch.int32,
                                                          device=r.device),
                                 block_size=r.block_size)
        r.model(empty, empty, r.kv_caches, meta)

    # ------------------------------------------------------------------ worker loop

    def worker_step(self) -> bool:
        """Rank > 0: receive one command, run it, send results. False on shutdown. A failed
        command is logged and skipped (the leader fails its requests); a receive error or a
        malformed frame means the channel is broken and propagates (the worker exits)."""
        frame = self.comm.broadcast_bytes(None, src=0)
        try:
            out = self.step(frame)
        except EpCommandFailed as exc:
            log.error("EpCommandFailed step=%d reason=%s", exc.step_id, exc.reason)
            self.failures.append(exc)
            return True
        except ProtocolError:
            raise
        if out is None:
            return False
        self.comm.gather_bytes(out, dst=0)
        return True
