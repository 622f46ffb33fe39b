"""A request and its sequences as the head sees them: tokens, text, stops, status.

Invariants: ``prompt_ids + output_ids`` is every token of the sequence; the model has KV for
the first ``state.seq_len`` of them while running, and at least the last one is always still
to be fed (it is the input of the next step). A sequence owns a ``SequenceState`` only while
running; preemption drops it and the sequence is prefilled again from its tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from epserve.head.detokenizer import IncrementalDetokenizer
from epserve.head.sampling_params import SamplingParams
from epserve.head.stops import StopChecker
from epserve.models.traits import PromptTokenLogprob, RowSampling, SampledToken, SequenceState


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_FINISHED = SeqStatus.FINISHED  # a module constant: ``SeqStatus.FINISHED`` costs a class lookup


@dataclass(eq=False)
class Sequence:
    """One of a request's ``n`` samples.

    Set by the engine at creation: ``request``, ``index``, ``seed``, ``stops``, ``detok``,
    ``grammar`` (a structured output's matcher, advanced by the engine per token),
    ``think_tags``, ``grammar_waits`` and ``think_may_open`` (a reasoning model's; the engine
    clears ``grammar_waits`` and sets ``thinking_closed`` when the row generates ``</think>``,
    and after the first token clears ``think_may_open``, setting ``grammar_waits`` when that
    token opened the reasoning).
    Set by the scheduler: ``status``, ``state``, ``admitted_at``, ``draft_state`` (its
    proposer's history of this sequence). Set by the engine per step:
    ``output_ids``, ``sampled``, ``finish_reason``, ``stop_reason``. Set by
    ``head.output_stream`` only: ``sent_tokens``, ``sent_chars``, ``sent_finish`` (what the
    client has been sent).
    """

    request: "Request"
    index: int
    seed: int
    stops: StopChecker
    detok: IncrementalDetokenizer
    output_ids: list[int] = field(default_factory=list)
    sampled: list[SampledToken] = field(default_factory=list)
    logprob_dicts: list = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    state: SequenceState | None = None
    admitted_at: int = -1
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_finish: bool = False
    grammar: Any = None  # head.grammar.SeqGrammar of a constrained sequence
    draft_state: Any = None  # the speculative proposer's, per sequence (written by the scheduler)
    # a reasoning model's (engine's --reasoning-parser): the thinking tags; whether its
    # thinking closed, by a "</think>" it generated or the prompt's last tag (both tags are
    # banned from then on); whether its grammar waits for
    # the reasoning to end (it neither masks nor advances until then)
    think_tags: Any = None  # head.reasoning.ThinkTags
    thinking_closed: bool = False
    grammar_waits: bool = False
    # the prompt has no thinking tag: the first token may open the reasoning (``<think>`` is
    # allowed beside the grammar's tokens) or start the constrained output
    think_may_open: bool = False
    _resample: bool = False  # the row's bans changed outside min_tokens: ship them

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    def all_tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    def banned_now(self) -> tuple[int, ...]:
        """The ids the row may not sample next: stop ids and EOS under ``min_tokens``, and
        both thinking tags once its thinking closed."""
        banned = self.stops.banned_ids(len(self.output_ids))
        if not self.thinking_closed:
            return banned
        return tuple(sorted(set(banned).union(self.think_tags.ids)))

    def close_thinking(self) -> None:
        """The row's thinking closed (it generated ``</think>``, or its prompt ended the
        block): from its next token on, neither tag (one sampling update to its rank, then
        nothing per step)."""
        if not self.thinking_closed:
            self.thinking_closed = self._resample = True

    def row_sampling(self) -> RowSampling:
        """The row's sampling now (bans change once ``min_tokens`` are out, and when its
        thinking closes)."""
        return self.request.params.to_row_sampling(self.seed, self.banned_now())

    def sync_state(self, admitted: bool = False) -> None:
        """Write the head's fields of ``state`` (the one writer of them): the row's sampling,
        its output index and whether its next step is likely (``lookahead``), and, when
        ``admitted`` (a fresh ``SequenceState``), its prompt facts. Every other field is the
        model's."""
        state, n = self.state, len(self.output_ids)
        if admitted:
            state.prompt_len = len(self.request.prompt_ids)
            if self.request.wants_prompt_logprobs:
                state.collect_prompt_logprobs = self.request.params.prompt_logprobs
            state.sampling = self.row_sampling()
        elif self.request.params.min_tokens >= n or self._resample:  # the bans changed
            state.sampling = self.row_sampling()
        self._resample = False
        state.output_index = n
        if self.grammar is not None:  # refilled in place after each token; none while waiting
            state.token_mask = None if self.grammar_waits else self.grammar.mask
        state.lookahead = n + 1 < self.request.max_tokens  # else the next one is the last

    @property
    def finished(self) -> bool:
        return self.status is _FINISHED


@dataclass(eq=False)
class Request:
    """A client's request: prompt, parameters and its sequences (``n`` of them).
    ``sent_prompt_logprobs`` / ``sent_finished``: written by ``head.output_stream`` only."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: int
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[PromptTokenLogprob] | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    user_data: Any = None
    sent_prompt_logprobs: bool = False
    sent_finished: bool = False
    # monotonic times for /metrics: came in (engine), first scheduled (scheduler), first token
    # (engine)
    arrived_s: float = 0.0
    scheduled_s: float | None = None
    first_token_s: float | None = None

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(genexpr): read several times per token
            if s.status is not _FINISHED:
                return False
        return True

    @property
    def max_budget(self) -> int:
        """Tokens this request can reach: prompt plus ``max_tokens``."""
        return len(self.prompt_ids) + self.max_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None
