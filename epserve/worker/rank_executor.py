"""RankExecutor: one rank's side of a step — validate, apply, run its rows, report.

Every rank runs the same ``run`` on the same command: rank 0 with the command handed over as
an object (one rank: nothing is encoded), ranks above 0 on the frame they received
(``ep_worker_step``, the seed's ``ModelEp::ep_worker_step`` body). So there is one validator
(``worker.ep_mirror``) and one input builder for every ``ep_size``. Invariants: an invalid
command raises ``EpCommandFailed`` on every rank and changes nothing; preparation that could
fail on one rank only ends in an agreement all-reduce, so all raise or none does; under EP a
rank with no rows still runs the forward (zero rows) and so joins every MoE collective. A
rank's sequences are its slots in the mirror (KV length, block count, prompt facts) and its
Runner's block tables; this module keeps only their sampling and last sampled token.
"""

from __future__ import annotations

import dataclasses
import logging
from operator import itemgetter
from typing import Any

import numpy as np

from epserve.kernels.token_mask import mask_words
from epserve.models.acceptance import accepted
from epserve.models.sampling_rules import resolve_max_logprobs
from epserve.models.traits import EpCommandFailed, RowSampling
from epserve.worker.batch import RankRows, StepInputs, VerifyRun
from epserve.worker.ep_mirror import EpMirror
from epserve.worker.ep_results import RankResult, encode_result
from epserve.worker.penalties import PenaltyBook
from epserve.worker.runner import Runner
from epserve.worker.step_command import (
    FEED_DEVICE, KIND_DECODE_AHEAD, KIND_SHUTDOWN, PrefillRow, ProtocolError, StepCommand,
    WireLimits, decode,
)

log = logging.getLogger(__name__)


class SoloComm:
    """The collectives of a group of one rank: agreement is one's own verdict."""

    def all_agree(self, ok: bool) -> bool:
        return ok


class RankExecutor:
    """Executes this rank's rows of each command on its Runner (model, KV, block tables)."""

    def __init__(self, runner: Runner, comm: Any, rank: int, world_size: int):
        self.runner = runner
        self.comm = comm
        self.rank = rank
        self.world_size = world_size
        max_slots = runner.cfg.max_num_seqs
        vocab = runner.model_config.vocab_size
        max_logprobs = resolve_max_logprobs(runner.cfg.max_logprobs, vocab)  # engine option
        self.mirror = EpMirror(world_size, runner.num_blocks, runner.block_size, max_slots,
                               runner.tables.max_blocks_per_seq, vocab,
                               lookahead=runner.lookahead is not None, max_logprobs=max_logprobs,
                               recurrent=runner.spare_state_slot is not None)
        # what a correct leader never exceeds: a frame beyond it is refused before any row
        # is built (bounds the work a hostile or corrupt frame can cause)
        self.limits = WireLimits(world_size, max_slots, runner.tables.max_blocks_per_seq,
                                 mask_words=mask_words(vocab), max_logprobs=max_logprobs)
        self.sampling: list[RowSampling | None] = [None] * max_slots
        self.last_token = np.full(max_slots, -1, dtype=np.int64)
        self.failures: list[EpCommandFailed] = []
        self.last_applied = -1
        self.last_logits: Any = None  # the last step's sampled rows' logits (one rank)
        self.folded: dict[int, int] = {}  # slot -> tokens its states hold after a verify
        self.penalties = PenaltyBook()  # penalized slots' tokens
        self._fed: dict[int, list[int]] = {}  # their tokens in the admitted step
        # the decode rows' keys (the mirror's array) and their samplings, for a repeat's reuse
        self._rows_sampling: tuple[Any, tuple] = (None, ())

    # ------------------------------------------------------------------ one step

    def step(self, frame: bytes) -> bytes | None:
        """Run one encoded command; the encoded ``RankResult``, or None for shutdown. Raises
        ``ProtocolError`` (broken channel) or ``EpCommandFailed`` (same on every rank)."""
        res = self.run(decode(frame, self.limits))
        return None if res is None else encode_result(res)

    def run(self, cmd: StepCommand) -> RankResult | None:
        """Run one command; this rank's ``RankResult``, or None for shutdown."""
        admitted = self.admit(cmd)
        return None if admitted is None else self.execute(cmd, *admitted)

    def admit(self, cmd: StepCommand) -> tuple[RankRows | None, StepInputs | None] | None:
        """The host half of a step: validate ``cmd``, apply it, and build this rank's rows and
        inputs (None for shutdown). ``EpCommandFailed`` as every rank raises it."""
        self.mirror.validate(cmd)
        if cmd.kind == KIND_SHUTDOWN:
            return None
        if self.runner.lookahead is not None and cmd.new_seqs:
            self.runner.lookahead.discard()  # a slot may hold a new sequence now
        self.mirror.apply(cmd)
        self.last_applied = cmd.step_id
        self._apply_local(cmd)
        err, rows, inp = None, None, None
        try:
            self._check_folds(cmd)
            rows = self._rows(cmd)
            if rows is not None:
                inp = self.runner.prepare(rows)
        except Exception as exc:  # e.g. an allocation on this rank only: agree first
            err = exc
        if not self.comm.all_agree(err is None):
            if err is not None:
                log.error("rank %d: preparing step %d failed: %s", self.rank, cmd.step_id, err)
            reason = (f"preparation failed on rank {self.rank} ({type(err).__name__})" if err
                      else "preparation failed on another rank")
            raise EpCommandFailed(cmd.step_id, reason)
        return rows, inp

    def _check_folds(self, cmd: StepCommand) -> None:
        """A recurrent model: this rank folded each verify row's accepted prefix into its
        states by its own verdict; the leader's rewinds must agree with it (the KV length and
        the states cover the same tokens)."""
        folded, self.folded = self.folded, {}
        for r in cmd.rewinds:
            if r.rank == self.rank and self.mirror.recurrent and folded.get(r.slot) != r.seq_len:
                raise ValueError(f"rewind of slot {r.slot} to {r.seq_len} tokens: its states "
                                 f"hold {folded.get(r.slot)}")

    def _apply_local(self, cmd: StepCommand) -> None:
        me, tables = self.rank, self.runner.tables
        for r in cmd.releases:
            if r.rank == me:
                self.sampling[r.slot] = None
                self.last_token[r.slot] = -1
                self.penalties.drop(r.slot)
        for n in cmd.new_seqs:
            if n.rank == me:
                self.sampling[n.slot] = n.sampling
                self.penalties.start(n.slot, n.sampling)
        for u in cmd.sampling_updates:
            if u.rank == me:
                self.sampling[u.slot] = u.sampling
                self.penalties.start(u.slot, u.sampling)
        for b in cmd.block_updates:
            if b.rank == me:
                tables.set_blocks(b.slot, b.first, b.blocks)

    def _rows(self, cmd: StepCommand) -> RankRows | None:
        """This rank's rows of an applied command (positions from the mirror, fed tokens from
        the command or this rank's last sample)."""
        self._fed = {}
        me = self.rank
        mirror = self.mirror  # the decode rows as validated (a repeat's kept rows first)
        slot, pos, oidx, feed = (mirror.decode_keys, mirror.decode_pos, mirror.decode_oidx,
                                 mirror.decode_feed)
        if self.world_size > 1:
            ms = mirror.max_slots
            mine = slot // ms == me
            slot, pos, oidx = slot[mine] % ms, pos[mine], oidx[mine]
            feed = None if feed is None else feed[mine]
        prefill = [p for p in cmd.prefill if p.rank == me]
        verify = [self._verify_run(v, at) for v, at in zip(cmd.verify, mirror.verify_pos)
                  if v.rank == me]
        if not len(slot) and not prefill and not verify:
            return None
        ids = (self.last_token[slot] if feed is None
               else np.where(feed == FEED_DEVICE, self.last_token[slot], feed))
        samp = self.sampling
        if mirror.decode_keys is self._rows_sampling[0] and not (
                cmd.new_seqs or cmd.sampling_updates or cmd.releases):  # a repeat of all rows
            sampling = list(self._rows_sampling[1])
        else:
            sampling = list(itemgetter(*slot.tolist())(samp)) if len(slot) > 1 else [
                samp[s] for s in slot.tolist()]
            self._rows_sampling = (mirror.decode_keys, tuple(sampling))
        output_index = oidx.tolist()
        if verify:  # each position a one-token row after the decode rows
            slot = np.concatenate([slot] + [np.full(len(v.tokens), v.slot) for v in verify])
            pos = np.concatenate([pos] + [np.arange(v.start, v.start + len(v.tokens))
                                          for v in verify])
            ids = np.concatenate([ids] + [v.tokens for v in verify])
        for v in verify:
            sampling.extend([samp[v.slot]] * len(v.tokens))
            output_index.extend(range(v.output_index, v.output_index + len(v.tokens)))
        for p in prefill:
            if p.sample:
                sampling.append(samp[p.slot])
                output_index.append(p.output_index)
        rows = RankRows(slot, pos, ids, prefill, sampling, output_index,
                        [self._prompt_logprobs(p) for p in prefill], verify=verify,
                        recurrent=self.mirror.recurrent, penalties=self._penalty_table(
                            slot, ids, prefill, verify, sampling))
        return self._with_masks(rows, cmd) if cmd.masks else rows

    def _penalty_table(self, slot: np.ndarray, ids: np.ndarray, prefill: list[PrefillRow],
                       verify: list[VerifyRun], sampling: list[RowSampling]) -> Any:
        """The step's ``PenaltyTable`` (None when no sampled row is penalized); keeps the
        penalized slots' fed tokens for ``execute`` to record."""
        book = self.penalties
        self._fed = {}
        if not book.history:
            return None
        if any(v.slot in book.history for v in verify):
            raise ValueError("a speculative verify of a sequence with sampling penalties")
        slots = slot.tolist()
        self._fed = book.fed(slots, ids.tolist(), [(p.slot, p.tokens) for p in prefill])
        infos = self.mirror.slots
        return book.table(slots + [p.slot for p in prefill if p.sample], sampling, self._fed,
                          lambda s: infos[(self.rank, s)].prompt_len)

    def _verify_run(self, v: Any, at: int) -> VerifyRun:
        feed = int(self.last_token[v.slot]) if v.feed == FEED_DEVICE else v.feed
        drafts = tuple(int(t) for t in v.drafts)
        return VerifyRun(v.slot, at, np.array((feed,) + drafts, dtype=np.int64), v.output_index,
                         drafts)

    def _with_masks(self, rows: RankRows, cmd: StepCommand) -> RankRows:
        """``rows`` with this rank's token masks, each at its row's place among the sampled
        rows (decode rows, then the sampled prefill rows)."""
        masks = [m for m in cmd.masks if m.rank == self.rank]
        if not masks:
            return rows
        place = {s: i for i, s in enumerate(rows.decode_slots.tolist())}  # decode rows first
        nd = rows.num_decode  # verify positions included (a verify row carries no mask)
        place.update((p.slot, nd + k) for k, p in enumerate(p for p in rows.prefill if p.sample))
        return dataclasses.replace(
            rows, mask_rows=np.array([place[m.slot] for m in masks], dtype=np.int64),
            mask_words=np.stack([np.asarray(m.words, dtype=np.int32) for m in masks]))

    def _prompt_logprobs(self, p: PrefillRow) -> tuple[int, tuple[int, ...]] | None:
        """(top-k, each position's next-token target or -1) for a collecting row, else None."""
        info = self.mirror.slots[(self.rank, p.slot)]
        if info.prompt_logprobs < 0:
            return None
        nxt = list(p.tokens[1:]) + [p.next_token]
        return info.prompt_logprobs, tuple(
            t if p.start + i + 1 < info.prompt_len else -1 for i, t in enumerate(nxt))

    def execute(self, cmd: StepCommand, rows: RankRows | None,
                inp: StepInputs | None) -> RankResult:
        """The device half of an admitted step: forward, sampling; this rank's result."""
        me = self.rank
        if rows is None:
            if self.world_size > 1:
                self.runner.empty_forward()
                if self.runner.mtp is not None:  # the head's passes exchange tokens too
                    self.runner.propose_drafts(None, None, [], [], self.mirror.nblocks[me])
            return RankResult(cmd.step_id, me, {}, {})
        ahead = cmd.kind == KIND_DECODE_AHEAD
        nblocks = self.mirror.nblocks[me][rows.decode_slots] if ahead else None
        out = self.runner.execute(rows, inp, ahead, nblocks)
        if self._fed:
            self.penalties.record(self._fed)
        self.last_logits = out.logits
        nv = rows.num_verify_positions
        nd = rows.num_decode - nv  # the decode rows; then the verify positions
        tokens, at = out.tokens, nd
        verified: dict[int, list] = {}
        kept = []
        for v in rows.verify:  # the target's token at each position; the accepted prefix is
            run = verified[v.slot] = tokens[at:at + len(v.tokens)]  # the drafts it equals,
            at += len(v.tokens)  # and the token after them is emitted
            a = accepted(v.drafts, run)
            self.last_token[v.slot] = run[a].token_id
            kept.append(a + 1)
            self.folded[v.slot] = v.start + a + 1
        if rows.recurrent and kept:  # the held states take the fed token and accepted drafts
            self.runner.fold_verified(inp, kept)
        drafts = ({} if self.runner.mtp is None else self.runner.propose_drafts(
            rows, inp, tokens, kept, self.mirror.nblocks[me]))
        if nv:
            tokens = tokens[:nd] + tokens[nd + nv:]
        slots = rows.decode_slots[:nd].tolist() + [p.slot for p in rows.prefill if p.sample]
        sampled = dict(zip(slots, tokens))
        if nd:
            self.last_token[rows.decode_slots[:nd]] = [t.token_id for t in tokens[:nd]]
        for s, tok in zip(slots[nd:], tokens[nd:]):
            self.last_token[s] = tok.token_id
        return RankResult(cmd.step_id, me, sampled, out.prompt_logprobs, verified, drafts)

    # ------------------------------------------------------------------ worker loop

    def ep_worker_step(self) -> bool:
        """Rank > 0 (the seed's ``ModelEp::ep_worker_step``): receive one command, run it, send
        results. False on shutdown. A failed
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
