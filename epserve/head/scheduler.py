"""The Scheduler: plans each step in one token-budget loop over running then waiting sequences.

There are no prefill and decode phases. Every running sequence has some tokens whose KV is not
written yet (a decode row has exactly one: its last sampled token; a prefilling one has the
rest of its prompt). The loop walks the running sequences in admission order, gives each
``min(uncomputed, budget)`` tokens, and reserves the KV blocks they need; when the pool is
short it first reclaims prefix-cache blocks, then preempts the newest running sequence (its
KV is dropped and it is prefilled again later, with the same output). What budget is left
admits waiting sequences in arrival order (preempted ones first), reusing cached prefix
blocks. With a proposer (speculative decoding) a decode row also carries drafted tokens, as
many as the budget, the request's remaining ``max_tokens`` and the free KV blocks allow (a
draft never preempts anything). Invariants: a planned row's blocks are reserved before the
forward; a sequence is in at most one of ``waiting`` / ``running``; nothing here touches torch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from typing import Any

from epserve.head.sequence import Sequence, SeqStatus
from epserve.models.sampling_rules import penalized
from epserve.models.traits import Model, PrefillSlice


@dataclass(frozen=True)
class SchedulerConfig:
    """Step limits. ``max_num_batched_tokens`` is the token budget of one step; a prompt
    longer than it is prefilled in chunks. ``long_prefill_token_threshold`` caps one prompt's
    chunk so that a long prompt leaves room for others (0 = no cap)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True


@dataclass
class StepPlan:
    """One step: decode rows (one token each, plus drafts with a proposer) and prefill chunks,
    plus who was preempted. ``drafts``: per decode row its drafted tokens, None without a
    proposer."""

    decode: list[Sequence] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    drafts: list[tuple[int, ...]] | None = None
    draft_caps: list[int] = field(default_factory=list)  # most drafts each decode row may get
    proposed: bool = False  # the proposer has drafted (rows planned later get no drafts)
    prefill: list[Sequence] = field(default_factory=list)
    slices: list[PrefillSlice] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return (len(self.decode) + sum(s.chunk_len for s in self.slices)
                + (sum(map(len, self.drafts)) if self.drafts else 0))


class Scheduler:
    """Owns the waiting queue and the running list; talks to the model only through its
    lifecycle trait (sequence allocation, block reservation, prefix cache)."""

    def __init__(self, model: Model, cfg: SchedulerConfig, proposer: Any = None,
                 num_speculative_tokens: int = 0, max_model_len: int = 1 << 62):
        """``proposer``: drafts tokens for decode rows (``head.speculative``), up to
        ``num_speculative_tokens`` a row and never past ``max_model_len``."""
        self.model = model
        self.cfg = cfg
        self.proposer, self.num_spec = proposer, num_speculative_tokens
        self.max_model_len = max_model_len
        self.block_size = model.kv_block_size() or 1
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admissions = 0
        self.num_preemptions = 0
        # tokens looked up in the prefix cache at admission, and those found (vLLM's counters)
        self.prefix_cache_queries = self.prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop ``seq`` from the queues and give its KV back (cached first, for reuse)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq, cache=True)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step

    def schedule(self) -> StepPlan:
        plan = StepPlan(drafts=[] if self.proposer is not None else None)
        budget = self.cfg.max_num_batched_tokens
        bs = self.block_size
        running = self.running
        decode, decode_tokens = plan.decode, plan.decode_tokens
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            state = seq.state
            out = seq.output_ids
            # Fast path, most rows of most steps: a decode row whose slot is already reserved
            # (KV for every token but the last: ``num_tokens - 1``, without the property call).
            if (out and state.seq_len == state.prompt_len + len(out) - 1
                    and state.seq_len < len(state.block_table) * bs):
                decode.append(seq)
                decode_tokens.append(out[-1])
                budget -= 1
                if plan.drafts is not None:
                    budget -= self._draft_cap(seq, budget, plan)
                i += 1
                continue
            n = self._chunk(seq, budget)
            if not self._reserve(seq, n, plan):
                if seq.status is not SeqStatus.RUNNING:
                    break  # it preempted itself: nothing newer is left to run
                continue
            budget -= self._plan_row(seq, n, plan, budget)
            i += 1
        if plan.drafts is not None:
            budget += self._propose(plan)
        if not plan.preempted:
            self._admit(plan, budget)
        return plan

    def _chunk(self, seq: Sequence, budget: int) -> int:
        left = seq.num_tokens - seq.state.seq_len
        cap = self.cfg.long_prefill_token_threshold
        if cap and left > 1:
            left = min(left, cap)
        return min(left, budget)

    def _plan_row(self, seq: Sequence, n: int, plan: StepPlan, budget: int) -> int:
        """Plan ``n`` reserved tokens of ``seq`` (a decode row or a prefill chunk); the
        budget it took (a decode row's drafts included)."""
        state = seq.state
        if n == 1 and state.seq_len == seq.num_tokens - 1 and seq.output_ids:
            plan.decode.append(seq)
            plan.decode_tokens.append(seq.output_ids[-1])
            if plan.drafts is None:
                return 1
            if plan.proposed:
                plan.drafts.append(())
                return 1
            return 1 + self._draft_cap(seq, budget - 1, plan)
        start = state.seq_len
        plan.prefill.append(seq)
        plan.slices.append(PrefillSlice(seq.all_tokens(), state, start, n,
                                        start + n == seq.num_tokens))
        return n

    def _draft_cap(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        """How many tokens decode row ``seq`` may draft (noted in ``plan.draft_caps``; their
        budget is held until the proposer has drafted): at most the budget, what is left of
        ``max_tokens`` after this step's own token, ``max_model_len``, and while
        ``min_tokens`` bans apply, none crossing where they lift (every position of a row is
        sampled under one ``RowSampling``). A constrained row gets none (its mask is known for
        one position only)."""
        req, n = seq.request, len(seq.output_ids)
        k = min(self.num_spec, budget, req.max_tokens - n - 1,
                self.max_model_len - seq.num_tokens)
        if n < req.params.min_tokens:
            k = min(k, req.params.min_tokens - n - 1)
        if seq.grammar is not None or penalized(seq.state.sampling):  # one position's mask /
            k = 0  # the penalties of one position's history
        plan.draft_caps.append(max(k, 0))
        return max(k, 0)

    def _propose(self, plan: StepPlan) -> int:
        """Draft for the planned decode rows in one batch and reserve KV for the drafts (a
        row whose blocks cannot be had drafts nothing: drafts never preempt); the budget
        held for drafts that were not made."""
        got = self.proposer.propose_batch(plan.decode, plan.draft_caps)
        plan.proposed, unused = True, 0
        for seq, cap, d in zip(plan.decode, plan.draft_caps, got):
            d = _before_think_end(seq, tuple(d[:cap]))
            if d and not self.model.reserve_blocks(seq.state, seq.state.seq_len + 1 + len(d)):
                d = ()
            plan.drafts.append(d)
            unused += cap - len(d)
        return unused

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Reserve KV for ``n`` more tokens of running ``seq``, reclaiming cached blocks, then
        preempting the newest running sequences; False when ``seq`` itself was preempted."""
        target = seq.state.seq_len + n
        while not self.model.reserve_blocks(seq.state, target):
            need = -(-target // self.block_size) - len(seq.state.block_table)
            if self.model.reclaim_prefix_blocks(need, seq.state) > 0:
                continue
            victim = self._newest_sharing_kv(seq)
            if victim is seq and (len(seq.state.block_table) + need
                                  > self.model.num_total_blocks(seq.state)):
                self._fail(seq, plan, f"the sequence needs {target} tokens of KV cache, more "
                                      f"than the whole pool holds")
                return False
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _newest_sharing_kv(self, seq: Sequence) -> Sequence:
        """The newest running sequence whose blocks come from ``seq``'s pool (preempting
        another frees nothing ``seq`` can use); ``seq`` itself at the latest."""
        for other in reversed(self.running):
            if self.model.shares_kv_pool(seq.state, other.state):
                return other
        raise AssertionError("the sequence being reserved is not running")

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self._release(seq, cache=True)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)

    def _fail(self, seq: Sequence, plan: StepPlan, reason: str) -> None:
        self.running.remove(seq)
        self._release(seq, cache=False)
        seq.status = SeqStatus.FINISHED
        plan.failed.append((seq, reason))

    def _release(self, seq: Sequence, cache: bool) -> None:
        if self.proposer is not None:
            self.proposer.release(seq)
        if seq.state is None:
            return
        if cache and self.cfg.enable_prefix_caching:
            self.model.cache_sequence(seq.state)
        self.model.free_sequence(seq.state)
        seq.state = None

    # ------------------------------------------------------------------ admission

    def _first_chunk(self, state, num_tokens: int, budget: int) -> int:
        """Reserve KV for a new sequence's first chunk: as much of the prompt as the budget,
        the chunk cap and the pool allow; 0 when not even one token fits."""
        n = min(num_tokens - state.seq_len, budget)
        cap = self.cfg.long_prefill_token_threshold
        if cap:
            n = min(n, cap)
        bs = self.block_size
        while not self.model.reserve_blocks(state, state.seq_len + n):
            free = self.model.num_free_blocks(state)
            room = (len(state.block_table) + free) * bs - state.seq_len
            if 1 <= room < n:
                n = room  # a smaller chunk fits now; the rest comes in later steps
                continue
            short = -(-(state.seq_len + n) // bs) - len(state.block_table) - free
            if self.model.reclaim_prefix_blocks(max(short, 1), state) == 0:
                return 0
        return n

    def _admit(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            tokens = seq.all_tokens()
            if self.cfg.enable_prefix_caching and not seq.request.wants_prompt_logprobs:
                # frees cached blocks other than the prompt's own prefix, in the pool the
                # prompt will be placed in; what is still short shrinks the first chunk
                self.model.reclaim_prefix_blocks_for(tokens, -1, -(-min(len(tokens), budget)
                                                                  // self.block_size))
            state = self.model.alloc_sequence_for(seq.request.max_budget, tokens)
            if -(-len(tokens) // self.block_size) > self.model.num_total_blocks(state):
                self.model.free_sequence(state)
                self.waiting.popleft()
                seq.status = SeqStatus.FINISHED
                plan.failed.append((seq, f"the sequence needs {len(tokens)} tokens of KV "
                                         f"cache, more than the whole pool holds"))
                continue
            seq.state = state
            seq.sync_state(admitted=True)
            if self.cfg.enable_prefix_caching:
                self.model.match_prefix(state, tokens)
                self.prefix_cache_queries += len(tokens)
                self.prefix_cache_hits += state.reused_prefix_tokens
                if not seq.output_ids:
                    seq.request.num_cached_tokens = max(seq.request.num_cached_tokens,
                                                        state.reused_prefix_tokens)
            n = self._first_chunk(state, len(tokens), budget)
            if n == 0:
                self.model.free_sequence(state)
                seq.state = None
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.admitted_at = self._admissions
            if seq.request.scheduled_s is None:
                seq.request.scheduled_s = time.monotonic()
            self._admissions += 1
            self.running.append(seq)
            budget -= self._plan_row(seq, n, plan, budget)


def _before_think_end(seq: Sequence, drafts: tuple[int, ...]) -> tuple[int, ...]:
    """``drafts`` up to (not including) a ``</think>`` while ``seq``'s thinking is open: the
    row's bans change once it has that tag, and every position of a verify row samples under
    one ``RowSampling``; so the tag may only be the run's last token (the target's own)."""
    tags = seq.think_tags
    if tags is None or seq.thinking_closed or tags.end not in drafts:
        return drafts
    return drafts[:drafts.index(tags.end)]
