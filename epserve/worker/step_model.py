"""StepModel: the ``Model`` for every ``ep_size``; each forward is one ``StepCommand``.

Keeps every rank's KV book (``worker.kv_book``: pools, slots, placement; the scheduler's
allocations happen here) and turns each forward call into one ``StepCommand`` that every rank's
``RankExecutor`` runs, rank 0 included: with one rank it is handed over as an object
(``LocalChannel``), with N it is encoded, broadcast and every rank's result gathered
(``EpChannel``). Invariants: what travels is the difference between the scheduler's sequences
and the mirror every rank holds (new sequences once, then new blocks, sampling changes,
releases); this class alone advances a ``SequenceState`` after a step; a command the ranks
refuse because of one sequence costs only that sequence (the step is re-issued without it) and
any other refusal raises ``EpCommandFailed`` here exactly as on every worker; under EP a failed
broadcast, gather or collective raises ``RankFailure`` (the group must be re-formed).
"""

from __future__ import annotations

import logging
import time
from itertools import repeat
from operator import attrgetter, is_
from typing import AbstractSet, Any, Callable, Sequence

from epserve.models.traits import (
    CapabilityAbsent, EpCommandFailed, ForwardDisclosure, MixedBatchResult, PrefillSlice,
    SampledToken, SequenceState,
)
from epserve.worker.channels import EpChannel, LocalChannel
from epserve.worker.ep_results import RankResult
from epserve.worker.forward_forms import ForwardForms
from epserve.worker.kv_book import KvBook, KvLifecycle
from epserve.worker.rank_executor import RankExecutor, SoloComm
from epserve.worker.runner import Runner
from epserve.worker.runner_config import RunnerConfig
from epserve.worker.shipment import RankView, Shipment
from epserve.models.acceptance import accepted
from epserve.worker.step_command import (
    KIND_DECODE_AHEAD, KIND_SHUTDOWN, KIND_STEP, MaskRow, PrefillRow, Release, Rewind,
    StepCommand, VerifyRow,
)

log = logging.getLogger(__name__)
_TOKEN_MASK = attrgetter("token_mask")


class StepModel(ForwardForms, KvLifecycle):
    """Rank 0's view of the engine's ranks (one or N), seen by the scheduler as one Model."""

    def __init__(self, rank0: RankExecutor, channel: LocalChannel | EpChannel, world_size: int,
                 keep_alive_s: float = 30.0):
        self.rank0, self.runner, self.channel, self.world_size = (rank0, rank0.runner, channel,
                                                                   world_size)
        r = self.runner
        self.model_config, self.max_model_len, self.block_size = (r.model_config,
                                                                   r.max_model_len, r.block_size)
        self.prefix_caching = r.prefix_caching  # off for a model with recurrent state
        self.mtp_drafts = r.cfg.mtp_drafts  # tokens the MTP head drafts per sampled row
        self.book = KvBook(world_size, r.num_blocks, r.block_size, r.cfg.max_num_seqs,
                           r.max_model_len, r.prefix_caching)
        self.view = RankView(world_size, r.cfg.max_num_seqs)
        self._fault: Callable[[StepCommand, Any], StepCommand] | None = None
        self._shipment: Shipment | None = None
        self.keep_alive_s = keep_alive_s
        self.last_round = time.monotonic()  # when the ranks last heard a command

    @classmethod
    def one_rank(cls, cfg: RunnerConfig) -> "StepModel":
        """The Model of a one-rank engine in this process."""
        rank0 = RankExecutor(Runner(cfg), SoloComm(), 0, 1)
        return cls(rank0, LocalChannel(rank0), 1)

    # ------------------------------------------------------------------ facts

    def capabilities(self) -> frozenset[str]:
        extra = {"ep"} if self.world_size > 1 else {"logits"}
        if self.runner.spare_state_slot is not None:  # recurrent state: each verify folds
            extra.add("ssm_state")  # its accepted prefix in on the rank (``ModelSsmState``)
        if self.mtp_drafts:  # its MTP head drafts after every step (``SequenceState.drafts``)
            extra.add("draft")
        return frozenset({"forward", "lifecycle", "streams", "circuit", "verify"} | extra)

    def forward_disclosure(self) -> ForwardDisclosure:
        return ForwardDisclosure()

    def is_ep(self) -> bool:
        return self.world_size > 1

    def kv_block_size(self) -> int | None:
        return self.block_size

    def vocab_size(self) -> int:
        return self.runner.vocab_size()

    def is_mla(self) -> bool:
        return False

    def hc_mult(self) -> int:
        return 0

    def supports_beam(self) -> bool:
        return False

    def generate_beam_batch(self, reqs: Sequence[Any]) -> list[list[int]]:
        raise CapabilityAbsent("beam search is not implemented by this model")

    @property
    def lookahead(self) -> Any:
        """Rank 0's decode lookahead (None without one), for its hit counts."""
        return self.runner.lookahead

    @property
    def pool(self) -> Any:
        """Rank 0's KV pool (stats and tests)."""
        return self.book.pools[0]

    def ep_worker_step(self) -> bool:
        raise CapabilityAbsent("ep_worker_step runs on ranks above 0 (RankExecutor); this is "
                               "rank 0")

    def ep_keep_alive(self) -> None:
        """While no step runs, the ranks wait in the command broadcast, which times out
        (``ep_timeout_s``) and would end them: every ``keep_alive_s`` of silence send a step
        with no rows (every rank runs an empty forward and answers). ``RankFailure`` as for a
        step. One rank waits on nothing."""
        if self.world_size > 1 and time.monotonic() - self.last_round >= self.keep_alive_s:
            self._issue((), (), ())

    def synchronize(self) -> None:
        self.runner.synchronize()

    def bind_gpu_to_thread(self) -> None:
        self.runner.bind_gpu_to_thread()

    def teardown(self) -> None:
        self.runner.teardown()

    def inject_fault(self, mutate: Callable[[StepCommand, Any], StepCommand]) -> None:
        """Apply ``mutate`` to the next command before it is sent (fault-injection tests)."""
        self._fault = mutate

    # ------------------------------------------------------------------ lifecycle

    def free_sequence(self, seq: SequenceState) -> None:
        key = (seq.rank, seq.slot_idx)
        if self.book.free_sequence(seq):
            self.view.forget(*key, known=key in self.rank0.mirror.slots)

    # ------------------------------------------------------------------ the step

    def mixed_forward_batch(self, decode_tokens: Sequence[int],
                            decode_seqs: Sequence[SequenceState],
                            prefill_slices: Sequence[PrefillSlice],
                            drafts: Sequence[Sequence[int]] | None = None) -> MixedBatchResult:
        """One step on every rank. ``drafts``: per decode row its drafted tokens (empty: a
        plain decode row); such a row is verified (``MixedBatchResult.verified``) and its
        sequence keeps the accepted prefix. When the ranks refuse the command because of one
        sequence's rows or updates (``EpCommandFailed.bad_rows``), only that sequence fails:
        it is left out (its rows and its pending rewind, which would be refused again) and the
        step is issued again with the others, so one request never fails the rest of its step.
        A refusal that names no sequence of this step, or only sequences already left out,
        fails the whole step (issuing it again could only repeat it)."""
        failed: dict[tuple[int, int], str] = {}
        keys: set[tuple[int, int]] | None = None
        strangers = 0  # refusals naming a row that is none of this step's sequences
        if drafts is not None and len(drafts) != len(decode_seqs):
            raise ValueError(f"{len(drafts)} draft lists for {len(decode_seqs)} decode rows")
        dt, ds, ps, dr = decode_tokens, decode_seqs, prefill_slices, drafts
        while True:
            if not ds and not ps:
                results: list[RankResult] = []
                break
            try:
                results = self._issue(dt, ds, ps, dr, failed.keys())
                break
            except EpCommandFailed as exc:
                if keys is None:
                    keys = {_key(s) for s in decode_seqs} | {_key(sl.seq) for sl in ps}
                bad = set(exc.bad_rows) & keys
                if not exc.bad_rows or (not bad and strangers) or (bad and bad <= failed.keys()):
                    raise
                strangers += not bad
                log.warning("step %d refused for %s: %s; re-issuing without them", exc.step_id,
                            sorted(bad) or "a row of no sequence", exc.reason)
                failed.update((k, f"this request's step was refused: {exc.reason}")
                              for k in bad)
            ok = [i for i, s in enumerate(decode_seqs) if _key(s) not in failed]
            dt, ds = [decode_tokens[i] for i in ok], [decode_seqs[i] for i in ok]
            dr = None if drafts is None else [drafts[i] for i in ok]
            ps = [sl for sl in prefill_slices if _key(sl.seq) not in failed]
        return self._assemble(decode_tokens, decode_seqs, prefill_slices, results, failed,
                              drafts)

    def _issue(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
               prefill_slices: Sequence[PrefillSlice],
               drafts: Sequence[Sequence[int]] | None = None,
               left_out: AbstractSet[tuple[int, int]] = frozenset()) -> list[RankResult]:
        """Build and run one command on every rank; every rank's result."""
        cmd = self.build_command(decode_tokens, decode_seqs, prefill_slices, drafts, left_out)
        if self._fault is not None:
            cmd, self._fault = self._fault(cmd, self.rank0.mirror), None
        self.view.rows = None  # until the step ran: the ranks' decode rows may change
        self.last_round = time.monotonic()
        try:
            results = self.channel.run(cmd)
        except EpCommandFailed:
            if self.rank0.last_applied == cmd.step_id:  # applied, then the ranks disagreed
                self._commit(cmd)
            raise
        self._commit(cmd)
        return results

    def _commit(self, cmd: StepCommand) -> None:
        """Every rank applied ``cmd``: what it shipped is now known everywhere."""
        self._shipment.commit(cmd.releases, cmd.rewinds)
        self.book.grown.clear()

    def _ahead(self, decode_seqs: Sequence[SequenceState],
               prefill_slices: Sequence[PrefillSlice], verify: bool) -> bool:
        """Whether this step may queue its successor (``KIND_DECODE_AHEAD``): rank 0 runs a
        decode lookahead, the step is pure decode, every row's next token is not known to be
        its last, and each row's next position gets its KV block now (it travels with the
        step; the scheduler would reserve it before the next step anyway)."""
        if self.runner.lookahead is None or prefill_slices or verify or not decode_seqs:
            return False
        limit = self.max_model_len - 2
        if not all(s.lookahead and s.seq_len <= limit for s in decode_seqs):
            return False
        reserve = self.book.reserve_ahead
        return all(reserve(s, s.seq_len + 2) for s in decode_seqs)

    def build_command(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                      prefill_slices: Sequence[PrefillSlice],
                      drafts: Sequence[Sequence[int]] | None = None,
                      left_out: AbstractSet[tuple[int, int]] = frozenset()) -> StepCommand:
        """The next command: the scheduler's rows plus what the ranks do not know yet.
        ``left_out``: sequences this step fails (refused by the ranks): their pending rewinds
        stay out of the command too (still pending; the engine releases such a sequence)."""
        if self.mtp_drafts:
            self._reserve_for_drafts(decode_seqs, prefill_slices, drafts)
        ship = self._shipment = Shipment(self.view)
        verify = []
        if drafts is not None and any(drafts):
            plain = [i for i, d in enumerate(drafts) if not d]
            for tok, seq, d in zip(decode_tokens, decode_seqs, drafts):
                if d:
                    ship.sequence(seq)
                    verify.append(VerifyRow(seq.rank, seq.slot_idx, self.view.feed(seq, tok),
                                            seq.output_index, tuple(d)))
            decode_tokens = [decode_tokens[i] for i in plain]
            decode_seqs = [decode_seqs[i] for i in plain]
        kind = (KIND_DECODE_AHEAD if self._ahead(decode_seqs, prefill_slices, bool(verify))
                else KIND_STEP)
        decode = ship.decode_rows(decode_tokens, decode_seqs, self.book.grown)
        masked = map(is_, map(_TOKEN_MASK, decode_seqs), repeat(None))  # rare: look in C
        prefill, masks = [], ([] if all(masked) else [
            MaskRow(s.rank, s.slot_idx, s.token_mask) for s in decode_seqs
            if s.token_mask is not None])
        for sl in prefill_slices:
            seq = sl.seq
            ship.sequence(seq)
            end = sl.chunk_start + sl.chunk_len
            nxt = sl.prompt_tokens[end] if end < len(sl.prompt_tokens) else -1
            prefill.append(PrefillRow(seq.rank, seq.slot_idx, sl.chunk_start,
                                      tuple(sl.prompt_tokens[sl.chunk_start:end]),
                                      sl.is_last_chunk, seq.output_index, nxt))
            if sl.is_last_chunk and seq.token_mask is not None:
                masks.append(MaskRow(seq.rank, seq.slot_idx, seq.token_mask))
        return StepCommand(
            step_id=self.rank0.mirror.next_step, kind=kind,
            releases=tuple(Release(r, s) for r, s in sorted(self.view.pending_releases)),
            new_seqs=tuple(ship.new), sampling_updates=tuple(ship.sampling),
            block_updates=tuple(ship.blocks), decode=decode, prefill=tuple(prefill),
            masks=tuple(masks), verify=tuple(verify), repeat=ship.repeat, dropped=ship.dropped,
            rewinds=tuple(Rewind(r, s, n, b) for (r, s), (n, b)
                          in sorted(self.view.pending_rewinds.items())
                          if (r, s) not in left_out))

    def _reserve_for_drafts(self, decode_seqs: Sequence[SequenceState],
                            prefill_slices: Sequence[PrefillSlice],
                            drafts: Sequence[Sequence[int]] | None) -> None:
        """KV blocks, when the pool has them, for the positions the MTP head's chained
        drafts run at after this step (up to ``mtp_drafts - 1`` past each sampled row's last
        position; they travel with the step). A row without them drafts fewer tokens."""
        extra, most = self.mtp_drafts - 1, self.max_model_len
        if not extra:
            return
        reserve = self.book.reserve_ahead
        for i, seq in enumerate(decode_seqs):
            reserve(seq, min(most, seq.seq_len + 1 + (len(drafts[i]) if drafts else 0) + extra))
        for sl in prefill_slices:
            if sl.is_last_chunk:
                reserve(sl.seq, min(most, sl.chunk_start + sl.chunk_len + extra))

    def _assemble(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                  prefill_slices: Sequence[PrefillSlice], results: list[RankResult],
                  failed: dict[tuple[int, int], str],
                  drafts: Sequence[Sequence[int]] | None = None) -> MixedBatchResult:
        """The step's result in the caller's row order, each sequence advanced past it; rows
        of ``failed`` sequences did not run (placeholders, listed in
        ``MixedBatchResult.failed``)."""
        out_decode: list[SampledToken] = []
        verified: dict[int, tuple[SampledToken, ...]] = {}
        errors: dict[int, str] = {}
        flats: list[int] = []  # the slots that sampled, and their tokens
        got_ids: list[int] = []
        flat = self.view.flat
        for i, (tok, seq) in enumerate(zip(decode_tokens, decode_seqs)):
            if failed and (seq.rank, seq.slot_idx) in failed:
                errors[i] = failed[(seq.rank, seq.slot_idx)]
                out_decode.append(SampledToken(-1))
                continue
            if drafts is not None and drafts[i]:
                got = self._verified(tok, seq, drafts[i], results[seq.rank], verified, i)
            else:
                got = results[seq.rank].sampled[seq.slot_idx]
                seq.tokens.append(tok)
                seq.seq_len += 1
                seq.kv_valid_tokens = seq.seq_len
            out_decode.append(got)
        if not failed and decode_seqs and not verified:
            flats = [flat(s) for s in decode_seqs]
            got_ids = [t.token_id for t in out_decode]
            self._shipment.ran(got_ids)  # a repeat of these rows may follow
        elif decode_seqs:
            ok = [i for i in range(len(decode_seqs)) if i not in errors]
            flats = [flat(decode_seqs[i]) for i in ok]
            got_ids = [out_decode[i].token_id if i not in verified else
                       verified[i][accepted(drafts[i], verified[i])].token_id for i in ok]
        out_prefill: list[SampledToken | None] = []
        for j, sl in enumerate(prefill_slices):
            seq, end = sl.seq, sl.chunk_start + sl.chunk_len
            key = (seq.rank, seq.slot_idx)
            if key in failed:
                errors[len(decode_seqs) + j] = failed[key]
                out_prefill.append(None)
                continue
            seq.tokens.extend(sl.prompt_tokens[sl.chunk_start:end])
            seq.seq_len = seq.kv_valid_tokens = end
            res = results[seq.rank]
            seq.prompt_logprobs.extend(res.prompt_logprobs.get(seq.slot_idx, ()))
            got = res.sampled.get(seq.slot_idx) if sl.is_last_chunk else None
            if got is not None:
                flats.append(flat(seq))
                got_ids.append(got.token_id)
            out_prefill.append(got)
        self.view.sampled(flats, got_ids)
        if self.mtp_drafts:  # what each sampled sequence's rank drafted after it
            for seq in [*decode_seqs, *(sl.seq for sl in prefill_slices if sl.is_last_chunk)]:
                if (seq.rank, seq.slot_idx) not in failed:
                    seq.drafts = tuple(results[seq.rank].drafts.get(seq.slot_idx, ()))
        logits = (self.rank0.last_logits if self.world_size == 1 and not failed and not verified
                  else None)
        nd = len(decode_seqs)
        return MixedBatchResult(
            decode=tuple(out_decode), prefill=tuple(out_prefill), failed=errors,
            verified=verified,
            decode_logits=logits[:nd] if logits is not None and nd else None,
            prefill_logits=logits[nd:] if logits is not None and logits.shape[0] > nd else None)

    def rewind_sequence(self, seq: SequenceState, num_tokens: int) -> None:
        """Keep ``seq``'s first ``num_tokens`` tokens of KV (a rejected tail, a draft model's
        drafts): its later blocks go back to the pool now, the ranks rewind with the next
        command."""
        if not 0 <= num_tokens <= len(seq.tokens):
            raise ValueError(f"rewind_sequence: {num_tokens} tokens, the sequence has "
                             f"{len(seq.tokens)}")
        del seq.tokens[num_tokens:]
        seq.seq_len = seq.kv_valid_tokens = num_tokens
        self.book.trim(seq, num_tokens)
        self.view.rewound(seq)

    def _verified(self, tok: int, seq: SequenceState, drafts: Sequence[int], res: RankResult,
                  verified: dict[int, tuple[SampledToken, ...]], i: int) -> SampledToken:
        """Advance a verified row's sequence past its accepted prefix, give back the blocks of
        the rejected tail and have the ranks rewind to it; the row's first token."""
        run = verified[i] = tuple(res.verified[seq.slot_idx])
        a = accepted(drafts, run)
        seq.tokens.append(tok)
        seq.tokens.extend(drafts[:a])
        seq.seq_len = seq.kv_valid_tokens = seq.seq_len + 1 + a
        if a < len(drafts) or -(-seq.seq_len // self.block_size) < len(seq.block_table):
            self.rewind_sequence(seq, seq.seq_len)  # the ranks hold KV for every position
        return run[0]

    def shutdown_workers(self) -> None:
        """Tell every worker to leave its loop (best effort)."""
        try:
            self.channel.run(StepCommand(step_id=self.rank0.mirror.next_step,
                                         kind=KIND_SHUTDOWN))
        except Exception as exc:
            log.warning("shutdown broadcast failed: %s", exc)


def _key(seq: SequenceState) -> tuple[int, int]:
    return seq.rank, seq.slot_idx
