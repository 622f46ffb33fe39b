"""EpLeaderRunner: the Model traits over N EP ranks, from rank 0.

Keeps every rank's KV book (``worker.kv_book``: pools, slots, placement; the scheduler's
allocations happen here), and turns each forward call into one ``StepCommand``: broadcast, run rank 0's rows, gather every rank's
sampled tokens. Invariants: what travels is the difference between the scheduler's sequences
and the mirror every rank holds (new sequences once, then new blocks, sampling changes,
releases); a command every rank refuses because of one sequence costs only that sequence (the
step is re-issued without it) and any other refusal raises ``EpCommandFailed`` here exactly as
on every worker; a failed broadcast, gather or collective raises ``RankFailure`` (the group
must be re-formed).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

from epserve.models.traits import (
    CapabilityAbsent, EpCommandFailed, ForwardDisclosure, MixedBatchResult, PrefillSlice,
    RankFailure, SampledToken, SequenceState,
)
from epserve.worker.ep_rank import EpRank
from epserve.worker.ep_results import decode_result
from epserve.worker.forward_forms import ForwardForms
from epserve.worker.kv_book import KvBook, KvLifecycle
from epserve.worker.step_command import (
    FEED_DEVICE, BlockUpdate, DecodeRows, NewSeq, PrefillRow, Release, SamplingUpdate,
    StepCommand, encode,
)

log = logging.getLogger(__name__)


class EpLeaderRunner(ForwardForms, KvLifecycle):
    """Rank 0 of an EP group, seen by the scheduler as one Model."""

    def __init__(self, rank0: EpRank, comm: Any, world_size: int, keep_alive_s: float = 30.0):
        self.rank0 = rank0
        self.runner = rank0.runner
        self.comm = comm
        self.world_size = world_size
        r = self.runner
        self.model_config = r.model_config
        self.max_model_len = r.max_model_len
        self.block_size = r.block_size
        self.book = KvBook(world_size, r.num_blocks, r.block_size, r.cfg.max_num_seqs,
                           r.max_model_len, r.cfg.enable_prefix_caching)
        self.pending_releases: set[tuple[int, int]] = set()
        self.shipped_sampling: dict[tuple[int, int], Any] = {}
        self.shipped_blocks: dict[tuple[int, int], int] = {}
        self.last_token: dict[tuple[int, int], int] = {}
        self._fault: Callable[[StepCommand, Any], StepCommand] | None = None
        self._shipment: _Shipment | None = None
        self.keep_alive_s = keep_alive_s
        self.last_round = time.monotonic()  # when the ranks last heard a command

    # ------------------------------------------------------------------ facts

    def capabilities(self) -> frozenset[str]:
        return frozenset({"forward", "lifecycle", "ep", "streams", "circuit"})

    def forward_disclosure(self) -> ForwardDisclosure:
        return ForwardDisclosure()

    def is_ep(self) -> bool:
        return True

    # Model-shape facts and absent capabilities are rank 0's runner's (one place says them).

    def kv_block_size(self) -> int | None:
        return self.runner.kv_block_size()

    def vocab_size(self) -> int:
        return self.runner.vocab_size()

    def is_mla(self) -> bool:
        return self.runner.is_mla()

    def hc_mult(self) -> int:
        return self.runner.hc_mult()

    def supports_beam(self) -> bool:
        return self.runner.supports_beam()

    def generate_beam_batch(self, reqs: Sequence[Any]) -> list[list[int]]:
        return self.runner.generate_beam_batch(reqs)

    def ep_worker_step(self) -> bool:
        raise CapabilityAbsent("ep_worker_step runs on ranks above 0; this is the leader")

    def ep_keep_alive(self) -> None:
        """While no step runs, the ranks wait in the command broadcast, which times out
        (``ep_timeout_s``) and would end them: every ``keep_alive_s`` of silence send a step
        with no rows (every rank runs an empty forward and answers). ``RankFailure`` as for a
        step."""
        if time.monotonic() - self.last_round >= self.keep_alive_s:
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
        if not self.book.free_sequence(seq):
            return
        if key in self.rank0.mirror.slots:  # the ranks know it: they must drop it
            self.pending_releases.add(key)
        self.shipped_sampling.pop(key, None)
        self.shipped_blocks.pop(key, None)
        self.last_token.pop(key, None)

    # ------------------------------------------------------------------ the step

    def mixed_forward_batch(self, decode_tokens: Sequence[int],
                            decode_seqs: Sequence[SequenceState],
                            prefill_slices: Sequence[PrefillSlice]) -> MixedBatchResult:
        """One step on every rank. When the ranks refuse the command because of one sequence's
        rows (``EpCommandFailed.bad_rows``), only that sequence fails: it is left out and the
        step is issued again with the others, so one request never fails the rest of its step.
        A refusal that names no sequence of this step fails the whole step."""
        failed: dict[tuple[int, int], str] = {}
        keys = {_key(s) for s in decode_seqs} | {_key(sl.seq) for sl in prefill_slices}
        strangers = 0  # refusals naming a row that is none of this step's sequences
        while True:
            d = [i for i, s in enumerate(decode_seqs) if _key(s) not in failed]
            p = [j for j, sl in enumerate(prefill_slices) if _key(sl.seq) not in failed]
            if not d and not p:
                frames = None
                break
            try:
                frames = self._issue([decode_tokens[i] for i in d], [decode_seqs[i] for i in d],
                                     [prefill_slices[j] for j in p])
                break
            except EpCommandFailed as exc:
                bad = set(exc.bad_rows) & keys
                if not exc.bad_rows or (not bad and strangers):
                    raise
                strangers += not bad
                log.warning("step %d refused for %s: %s; re-issuing without them", exc.step_id,
                            sorted(bad) or "a row of no sequence", exc.reason)
                failed.update((k, f"the expert-parallel ranks refused this request's step: "
                                  f"{exc.reason}") for k in bad)
        return self._assemble(decode_tokens, decode_seqs, prefill_slices, frames, failed)

    def _issue(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
               prefill_slices: Sequence[PrefillSlice]) -> list[bytes]:
        """Build, broadcast and run one command; every rank's result frame."""
        cmd = self.build_command(decode_tokens, decode_seqs, prefill_slices)
        if self._fault is not None:
            cmd, self._fault = self._fault(cmd, self.rank0.mirror), None
        frame = encode(cmd)
        self.last_round = time.monotonic()
        try:
            self.comm.broadcast_bytes(frame, src=0)
        except Exception as exc:
            raise RankFailure(f"broadcast of step {cmd.step_id} failed: {exc}") from exc
        try:
            mine = self.rank0.step(frame)
        except EpCommandFailed:
            if self.rank0.last_applied == cmd.step_id:  # applied, then the ranks disagreed
                self._commit(cmd)
            raise
        except Exception as exc:
            raise RankFailure(f"step {cmd.step_id} failed on rank 0: {exc}") from exc
        try:
            frames = self.comm.gather_bytes(mine, dst=0)
        except Exception as exc:
            raise RankFailure(f"gathering step {cmd.step_id} failed: {exc}") from exc
        self._commit(cmd)
        return frames

    def _commit(self, cmd: StepCommand) -> None:
        """Every rank applied ``cmd``: what it shipped is now known everywhere."""
        self.pending_releases.difference_update((r.rank, r.slot) for r in cmd.releases)
        self._shipment.commit()

    def build_command(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                      prefill_slices: Sequence[PrefillSlice]) -> StepCommand:
        """The next command: the scheduler's rows plus what the ranks do not know yet."""
        ship = self._shipment = _Shipment(self)
        ranks, slots, feeds, oidx = [], [], [], []
        last = self.last_token
        for tok, seq in zip(decode_tokens, decode_seqs):
            key = ship.sequence(seq)
            ranks.append(key[0])
            slots.append(key[1])
            feeds.append(FEED_DEVICE if last.get(key) == tok else tok)
            oidx.append(seq.output_index)
        prefill = []
        for sl in prefill_slices:
            seq = sl.seq
            ship.sequence(seq)
            end = sl.chunk_start + sl.chunk_len
            nxt = sl.prompt_tokens[end] if end < len(sl.prompt_tokens) else -1
            prefill.append(PrefillRow(seq.rank, seq.slot_idx, sl.chunk_start,
                                      tuple(sl.prompt_tokens[sl.chunk_start:end]),
                                      sl.is_last_chunk, seq.output_index, nxt))
        return StepCommand(
            step_id=self.rank0.mirror.next_step,
            releases=tuple(Release(r, s) for r, s in sorted(self.pending_releases)),
            new_seqs=tuple(ship.new), sampling_updates=tuple(ship.sampling),
            block_updates=tuple(ship.blocks), decode=DecodeRows.of(ranks, slots, feeds, oidx),
            prefill=tuple(prefill))

    def _assemble(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                  prefill_slices: Sequence[PrefillSlice], frames: list[bytes] | None,
                  failed: dict[tuple[int, int], str]) -> MixedBatchResult:
        """The step's result in the caller's row order; rows of ``failed`` sequences did not
        run (placeholders, listed in ``MixedBatchResult.failed``)."""
        results = [decode_result(f, self.rank0.limits) for f in frames] if frames else []
        out_decode: list[SampledToken] = []
        errors: dict[int, str] = {}
        for i, (tok, seq) in enumerate(zip(decode_tokens, decode_seqs)):
            if _key(seq) in failed:
                errors[i] = failed[_key(seq)]
                out_decode.append(SampledToken(-1))
                continue
            got = results[seq.rank].sampled[seq.slot_idx]
            seq.tokens.append(tok)
            seq.seq_len += 1
            seq.kv_valid_tokens = seq.seq_len
            self.last_token[(seq.rank, seq.slot_idx)] = got.token_id
            out_decode.append(got)
        out_prefill: list[SampledToken | None] = []
        for j, sl in enumerate(prefill_slices):
            seq, end = sl.seq, sl.chunk_start + sl.chunk_len
            if _key(seq) in failed:
                errors[len(decode_seqs) + j] = failed[_key(seq)]
                out_prefill.append(None)
                continue
            seq.tokens.extend(sl.prompt_tokens[sl.chunk_start:end])
            seq.seq_len = seq.kv_valid_tokens = end
            res = results[seq.rank]
            seq.prompt_logprobs.extend(res.prompt_logprobs.get(seq.slot_idx, ()))
            got = res.sampled.get(seq.slot_idx) if sl.is_last_chunk else None
            if got is not None:
                self.last_token[(seq.rank, seq.slot_idx)] = got.token_id
            out_prefill.append(got)
        return MixedBatchResult(decode=tuple(out_decode), prefill=tuple(out_prefill),
                                failed=errors)

    def shutdown_workers(self) -> None:
        """Tell every worker to leave its loop (best effort)."""
        cmd = StepCommand(step_id=self.rank0.mirror.next_step, kind=1)
        try:
            frame = encode(cmd)
            self.comm.broadcast_bytes(frame, src=0)
            self.rank0.step(frame)
        except Exception as exc:
            log.warning("shutdown broadcast failed: %s", exc)


def _key(seq: SequenceState) -> tuple[int, int]:
    return seq.rank, seq.slot_idx


class _Shipment:
    """Collects, for one command, what each named sequence needs the ranks to learn. The
    leader's view of what the ranks know (``shipped_*``) changes only once the command ran."""

    def __init__(self, leader: EpLeaderRunner):
        self.leader = leader
        self.new: list[NewSeq] = []
        self.sampling: list[SamplingUpdate] = []
        self.blocks: list[BlockUpdate] = []
        self.sampling_sent: dict[tuple[int, int], Any] = {}
        self.blocks_sent: dict[tuple[int, int], int] = {}

    def sequence(self, seq: SequenceState) -> tuple[int, int]:
        leader = self.leader
        key = (seq.rank, seq.slot_idx)
        shipped = leader.shipped_blocks.get(key)
        if shipped is None or key in leader.pending_releases:
            self.new.append(NewSeq(seq.rank, seq.slot_idx, seq.seq_len, max(seq.prompt_len, 1),
                                   -1 if seq.collect_prompt_logprobs is None
                                   else seq.collect_prompt_logprobs,
                                   seq.sampling))
            self.sampling_sent[key] = seq.sampling
            shipped = 0
        elif leader.shipped_sampling.get(key) is not seq.sampling:
            self.sampling.append(SamplingUpdate(seq.rank, seq.slot_idx,
                                                seq.sampling))
            self.sampling_sent[key] = seq.sampling
        n = len(seq.block_table)
        if n > shipped or shipped == 0:
            if n > shipped:
                self.blocks.append(BlockUpdate(seq.rank, seq.slot_idx, shipped,
                                               tuple(seq.block_table[shipped:])))
            self.blocks_sent[key] = n
        return key

    def commit(self) -> None:
        self.leader.shipped_sampling.update(self.sampling_sent)
        self.leader.shipped_blocks.update(self.blocks_sent)
