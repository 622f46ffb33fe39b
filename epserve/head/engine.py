"""The Engine: requests in, one model step per ``step()``, ``RequestOutput``s out.

A step is: plan (Scheduler), one ``mixed_forward_batch`` on the model, then per sampled token:
append, detokenize incrementally, check stops, finish. With speculative decoding a decode row
may emit several tokens (its accepted drafts and the target's next one), appended one by one
so that a stop or ``max_tokens`` cuts the run at the right token. Invariants: a request that is refused
at ``add_request`` leaves no trace; a request that fails in a step is finished with its error
and its KV freed, and the other requests go on; the text a running output shows never ends in
something that could still become a stop string.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

from epserve.head.detokenizer import IncrementalDetokenizer
from epserve.head.grammar import GrammarBook
from epserve.head.limits import RequestLimits
from epserve.head.output_builder import build_output
from epserve.head.request_timing import EngineTimings
from epserve.head.outputs import RequestOutput
from epserve.head.reasoning import ThinkTags
from epserve.head.sampling_params import SamplingParams
from epserve.head.scheduler import Scheduler, SchedulerConfig, StepPlan
from epserve.head.sequence import Request, SeqStatus, Sequence
from epserve.head.speculative import SpeculativeConfig, SpecStats
from epserve.head.stop_automaton import StopAutomaton
from epserve.head.stops import StopChecker
from epserve.models.acceptance import accepted
from epserve.models.sampling_rules import token_ids_problem
from epserve.models.traits import (
    EpCommandFailed, MixedBatchResult, Model, RankFailure, SampledToken, require_capability,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int] = frozenset()
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    limits: RequestLimits = RequestLimits()
    speculative: SpeculativeConfig | None = None
    think_tags: ThinkTags | None = None  # a reasoning model's (head.reasoning)


@dataclass
class EngineStats:
    """Counters the server's /metrics reads."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    spec: SpecStats = field(default_factory=SpecStats)


def _public_reason(exc: BaseException) -> str:
    """What a client may read of a failed step: the ranks' own verdict, or the error's type
    and a reference into the server log (never file paths, addresses or tensor dumps)."""
    if isinstance(exc, EpCommandFailed):
        return f"the expert-parallel ranks refused this step: {exc.reason}"
    ref = f"{random.getrandbits(32):08x}"
    log.error("step failure reference %s: %s: %s", ref, type(exc).__name__, exc, exc_info=exc)
    return f"the engine failed this step ({type(exc).__name__}; server log reference {ref})"


def _mix_seed(seed: int, index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) % (1 << 63)


class Engine:
    """Single-loop engine over a ``Model``; not thread-safe (one caller drives ``step``)."""

    def __init__(self, model: Model, tokenizer: Any, cfg: EngineConfig,
                 draft: Model | None = None):
        """``draft``: the draft model of a ``draft_model`` speculative config."""
        self.model = model
        self.tokenizer = tokenizer
        # an EOS id outside the model's vocabulary can never be sampled: it is no stop, and
        # banning it under min_tokens would make every rank refuse the row
        self.cfg = dataclasses.replace(cfg, eos_token_ids=frozenset(
            t for t in cfg.eos_token_ids if 0 <= t < cfg.vocab_size))
        spec = cfg.speculative
        if spec is not None:
            require_capability(model, "verify", "speculative decoding")
            if spec.method == "mtp":
                require_capability(model, "draft", "speculative_config method 'mtp'")
            if draft is not None and "ssm_state" in draft.capabilities():
                raise ValueError("a draft model with recurrent state (gated DeltaNet) cannot "
                                 "draft: its drafts would have to be rewound, and its states "
                                 "only go back inside a verify; use a draft model without "
                                 "linear-attention layers")
        self.scheduler = Scheduler(model, cfg.scheduler,
                                   spec.proposer(draft) if spec is not None else None,
                                   spec.num_speculative_tokens if spec is not None else 0,
                                   cfg.max_model_len)
        self.grammars = GrammarBook(tokenizer, cfg.vocab_size, self.cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.timings = EngineTimings()
        self._rng = random.Random(cfg.seed)
        self._arrivals = itertools.count()
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str | None, prompt_ids: Seq[int], params: SamplingParams,
                    prompt: str | None = None) -> Request:
        """Queue a request; ``ValueError`` naming the field when it cannot be served."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.check_request(prompt_ids, params)
        room = self.cfg.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        req = Request(request_id, prompt, ids, params, max_tokens, next(self._arrivals))
        req.arrived_s = time.monotonic()
        automaton = StopAutomaton(params.stop)  # once per request: its n completions share it
        so = params.structured_outputs
        compiled = self.grammars.compile(so) if so is not None else None
        tags = self.cfg.think_tags
        closed = tags is not None and tags.closed_by(ids, self.tokenizer.decode)
        for i in range(params.n):
            seed = (_mix_seed(params.seed, i) if params.seed is not None
                    else self._rng.getrandbits(63))
            stops = StopChecker(
                stop=params.stop, stop_token_ids=frozenset(params.stop_token_ids or ()),
                eos_token_ids=self.cfg.eos_token_ids, ignore_eos=params.ignore_eos,
                min_tokens=params.min_tokens, max_tokens=max_tokens,
                include_stop_str_in_output=params.include_stop_str_in_output,
                automaton=automaton)
            detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            seq = Sequence(req, i, seed, stops, detok, think_tags=tags)
            if closed:
                seq.close_thinking()
            if compiled is not None:
                seq.grammar = self.grammars.matcher(compiled)
                self._gate_grammar(seq, so.enable_in_reasoning, ids, closed)
                if not seq.grammar.fill(seq.banned_now()):
                    raise ValueError(f"SamplingParams.structured_outputs.{so.kind}: no token of "
                                     f"this model's vocabulary can start the output")
                if seq.think_may_open:
                    seq.grammar.allow(seq.think_tags.start)
            req.seqs.append(seq)
        self.requests[request_id] = req
        for seq in req.seqs:
            self.scheduler.add(seq)
        self.stats.prompt_tokens += len(ids)
        return req

    @staticmethod
    def _gate_grammar(seq: Sequence, in_reasoning: bool, prompt_ids: list[int],
                      closed: bool) -> None:
        """A reasoning model's constraint holds once the reasoning ended (vLLM's rule): at
        once when the prompt closed it (``closed``: ``ThinkTags.closed_by``) or with
        ``in_reasoning``, after ``</think>`` when the prompt opened it, and otherwise (no tag:
        a completions prompt, a template that leaves thinking to the model; or an earlier
        turn's ``</think>``) the first token decides: ``<think>`` opens the reasoning, any
        other must be the constraint's (vLLM waits for a ``</think>`` that may never come
        there: vllm#57726)."""
        tags = seq.think_tags
        if tags is None or in_reasoning or closed:
            return
        seq.grammar_waits = tags.last_tag(prompt_ids) == tags.start
        seq.think_may_open = not seq.grammar_waits

    def check_request(self, prompt_ids: Seq[int], params: SamplingParams) -> list[int]:
        """The prompt as a list when this engine can serve the request, else ``ValueError``
        naming the field. Reads only the config, so any thread may call it (the async engine
        checks a request on the caller's side before it queues it for the engine thread)."""
        self.cfg.limits.check(params)
        ids = list(prompt_ids)
        if not ids:
            raise ValueError("prompt_token_ids: the prompt is empty")
        bad = token_ids_problem(ids, self.cfg.vocab_size)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: {bad}")
        if len(ids) >= self.cfg.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within "
                             f"max_model_len={self.cfg.max_model_len}")
        # stop ids are banned under min_tokens: the ranks accept only vocabulary ids there
        bad = token_ids_problem(params.stop_token_ids or (), self.cfg.vocab_size)
        if bad is not None:
            raise ValueError(f"SamplingParams.stop_token_ids: {bad}")
        bad = token_ids_problem(params.logit_bias or (), self.cfg.vocab_size)
        if bad is not None:
            raise ValueError(f"SamplingParams.logit_bias: {bad}")
        if params.structured_outputs is not None:  # compiled here, off the engine thread
            self.grammars.compile(params.structured_outputs)
        return ids

    def abort_request(self, request_id: str) -> None:
        """Finish a request now ("abort") and free its KV; unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
            key = seq.finish_reason or "abort"
            self.stats.finished[key] = self.stats.finished.get(key, 0) + 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def keep_alive(self) -> None:
        """Called while idle: lets an EP model keep its ranks' channel open."""
        self.model.ep_keep_alive()

    # ------------------------------------------------------------------ a broken model

    def adopt(self, old: "Engine") -> None:
        """Take over ``old``'s unfinished requests (its model died; this one replaces it).

        Each unfinished sequence keeps its tokens, text and stop state and is prefilled again
        on this model from prompt + output, as after a preemption: its seed and output index
        are unchanged, so it goes on as it would have. Counters carry over. Nothing of
        ``old``'s model is called (it is dead); call with ``old``'s loop stopped."""
        for req in old.requests.values():
            for seq in req.seqs:
                if not seq.finished:
                    seq.state = seq.draft_state = None  # both belonged to the dead engine
                    self.scheduler.add(seq)
            self.requests[req.request_id] = req
        old.requests = {}
        self.stats = old.stats
        self.timings = old.timings
        self._rng, self._arrivals, self._ids = old._rng, old._arrivals, old._ids

    def fail_all(self, reason: str) -> list[Request]:
        """Finish every unfinished request with ``reason`` as its error, keeping the tokens
        and text it has; returns them. Touches no model (it may be dead or stuck in a step on
        another thread)."""
        failed = list(self.requests.values())
        for req in failed:
            for seq in req.seqs:
                if not seq.finished:
                    seq.status = SeqStatus.FINISHED
                    seq.finish_reason = "error"
            req.error = req.error or reason
        self.requests = {}
        return failed

    # ------------------------------------------------------------------ the step

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one model step; the outputs of every request that changed in it (only of those
        that finished in it with ``finished_only``: an offline batch reads nothing else, and
        building a cumulative output per running request per step costs the host
        O(prompt + output) each)."""
        return [build_output(req, self.tokenizer) for req in self.advance()
                if req.finished or not finished_only]

    def advance(self) -> list[Request]:
        """Run one model step; every request it changed, in the order it changed them. The
        finished ones are retired (no longer in ``requests``; counted in ``stats``)."""
        plan = self.scheduler.schedule()
        if not plan.empty:
            self.timings.step(plan.num_tokens)
        touched: dict[str, Request] = {}
        for seq, reason in plan.failed:
            self._fail_seq(seq, reason, touched)
        if not plan.empty:
            states = [s.state for s in plan.decode]
            try:
                if plan.drafts is not None and any(plan.drafts):
                    result = self.model.mixed_forward_batch(plan.decode_tokens, states,
                                                            plan.slices, plan.drafts)
                else:
                    result = self.model.mixed_forward_batch(plan.decode_tokens, states,
                                                            plan.slices)
            except RankFailure:
                raise  # the group is broken: the caller re-forms it and replays
            except (EpCommandFailed, ValueError, RuntimeError) as exc:
                reason = _public_reason(exc)
                log.error("step failed, failing its %d sequences (%s): %s",
                          len(plan.decode) + len(plan.prefill), reason, exc)
                for seq in plan.decode + plan.prefill:
                    self._fail_seq(seq, reason, touched)
            else:
                self._apply(plan, result, touched)
        return self._retire(touched)

    def _apply(self, plan: StepPlan, result: MixedBatchResult, touched: dict[str, Request]) -> None:
        failed, m = result.failed, len(plan.decode)
        verified = result.verified
        for i, (seq, tok) in enumerate(zip(plan.decode, result.decode)):
            if i in failed:
                self._fail_seq(seq, failed[i], touched)
            elif i in verified:
                run, drafts = verified[i], plan.drafts[i]
                a = accepted(drafts, run)
                self.stats.spec.record(drafts, a)
                for t in run[:a + 1]:
                    self._append(seq, t, touched)
            else:
                self._append(seq, tok, touched)
        for j, (seq, sl, tok) in enumerate(zip(plan.prefill, plan.slices, result.prefill)):
            if m + j in failed:
                self._fail_seq(seq, failed[m + j], touched)
                continue
            req = seq.request
            if req.wants_prompt_logprobs and sl.is_last_chunk and seq.state is not None:
                req.prompt_logprobs = list(seq.state.prompt_logprobs)
            if tok is not None:
                self._append(seq, tok, touched)

    def _append(self, seq: Sequence, tok: SampledToken, touched: dict[str, Request]) -> None:
        if seq.finished:
            return
        g = None if seq.grammar_waits else seq.grammar
        if seq.think_may_open:  # the first token: it opened the reasoning, or it is the output's
            seq.think_may_open = False
            if tok.token_id == seq.think_tags.start:
                seq.grammar_waits, g = True, None
        if g is not None and not g.accept(tok.token_id):  # the mask allowed it: never expected
            self._fail_seq(seq, f"structured output: the grammar refused token {tok.token_id}",
                           touched)
            return
        seq.output_ids.append(tok.token_id)
        seq.sampled.append(tok)
        if seq.request.first_token_s is None:
            seq.request.first_token_s = time.monotonic()
        self.stats.generation_tokens += 1
        n = len(seq.output_ids)
        before = len(seq.detok.text)
        seq.detok.add(tok.token_id)
        reason, stop_reason = seq.stops.check_token(tok.token_id, n)
        text = seq.detok.text
        found = seq.stops.find_stop(text, len(text) - before, n)
        if found is not None:
            reason, stop_reason = "stop", found[1]
            text = text[:found[0]]
        elif reason == "stop" and not seq.request.params.include_stop_str_in_output:
            text = text[:before]  # a stop token's own text is not part of the output
        if reason is None and g is not None and g.terminated:  # its stop token, ignore_eos
            reason, text = "stop", text[:before]
        seq.text = text
        if seq.think_tags is not None and tok.token_id == seq.think_tags.end:
            # thinking closed for good; a grammar that waited for the reasoning to end holds
            # from the next token (the tag itself is not fed to it, as vLLM's)
            seq.close_thinking()
            seq.grammar_waits, g = False, seq.grammar
        if reason is None and g is not None and not g.fill(seq.banned_now()):
            self._fail_seq(seq, "structured output: the grammar allows no token this request "
                           "may sample next", touched)
            return
        if reason is None and seq.num_tokens >= self.cfg.max_model_len:
            reason = "length"
        if reason is not None:
            if found is None and reason != "stop":
                seq.text += seq.detok.finish()  # flush bytes held back for a partial char
            seq.finish_reason, seq.stop_reason = reason, stop_reason
            self.scheduler.finish(seq)
        elif seq.state is not None:
            seq.sync_state()
        touched[seq.request.request_id] = seq.request

    def _fail_seq(self, seq: Sequence, reason: str, touched: dict[str, Request]) -> None:
        if not seq.finished:
            self.scheduler.finish(seq)
        seq.finish_reason = "error"
        seq.request.error = reason
        touched[seq.request.request_id] = seq.request

    def _retire(self, touched: dict[str, Request]) -> list[Request]:
        now = time.monotonic()
        for req in touched.values():
            if req.finished:
                self.requests.pop(req.request_id, None)
                self.timings.finished(req, now)
                for seq in req.seqs:
                    key = seq.finish_reason or "abort"
                    self.stats.finished[key] = self.stats.finished.get(key, 0) + 1
        return list(touched.values())
