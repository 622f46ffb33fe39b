"""LlmBackend: what the offline ``LLM`` needs of an engine, wherever the engine runs.

Two implementations: ``LocalBackend`` (this module: an ``Engine`` stepped in this process,
ep_size=1) and ``RemoteEngine`` (``remote_engine.py``: an engine in a HeadActor on Ray, EP).
``LLM`` picks one at construction and calls it without asking which it has. (Not the HTTP
ingress's ``deploy.engine_client.EngineClient``, which is asynchronous and speaks to the head.)

Invariants: prompts reach a backend encoded (text or None, token ids) with their
``SamplingParams``, already checked by ``LLM`` for shape; ``check_request`` refuses a request
before anything is queued (a backend whose engine checks on arrival, as the head does, checks
there instead); ``generate`` returns one finished ``RequestOutput`` per prompt in order and
leaves nothing queued when it raises; ``stream`` queues its request on the first ``next()``
and closing it early aborts the request; ``close`` is safe to call twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Protocol, Sequence

from epserve.cluster.engine_args import EngineArgs, build_engine
from epserve.head.async_engine import engine_snapshot
from epserve.head.output_builder import build_output
from epserve.head.outputs import RequestOutput
from epserve.head.sampling_params import SamplingParams
from epserve.head.sequence import Request
from epserve.models.traits import BeamReq

Encoded = tuple[str | None, list[int]]


class LlmBackend(Protocol):
    """One engine as ``LLM`` drives it (synchronous; one caller at a time)."""

    #: the HF tokenizer, or None when the checkpoint ships none
    tokenizer: Any
    #: the in-process ``Engine`` and its ``Model``, for tests and benchmarks that drive them
    #: step by step; None where the engine runs in another process
    engine: Any
    model: Any

    def capabilities(self) -> frozenset[str]:
        """The model's capabilities (what ``require_capability`` reads)."""

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """``ValueError`` when the engine would refuse this request; queues nothing."""

    def generate(self, prompts: Sequence[Encoded], params: Sequence[SamplingParams],
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to the end; one output per prompt, in order."""

    def stream(self, text: str | None, ids: list[int], params: SamplingParams
               ) -> Iterator[RequestOutput]:
        """The request's cumulative output after each step that changed it; the last one is
        finished."""

    def beam_search(self, reqs: Sequence[BeamReq]) -> list[list[int]]:
        """Beam search on a model with the 'beam' capability."""

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (running, waiting, KV usage, tokens, preemptions, finished)."""

    def health(self) -> dict[str, Any]:
        """``{"healthy": bool, "reason": str | None}``."""

    def close(self) -> None:
        """Release what the engine holds beyond this process; safe to call twice."""


class LocalBackend:
    """An ``Engine`` over a one-rank ``StepModel`` in this process, stepped by the calling
    thread."""

    def __init__(self, args: EngineArgs):
        self.engine, self.model, self.tokenizer = build_engine(args)

    def capabilities(self) -> frozenset[str]:
        return self.model.capabilities()

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(ids, params)

    def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(engine_snapshot(self.engine, None))

    def health(self) -> dict[str, Any]:
        return {"healthy": True, "reason": None}

    def close(self) -> None:
        pass  # nothing outside this process to release

    def beam_search(self, reqs: Sequence[BeamReq]) -> list[list[int]]:
        return self.model.generate_beam_batch(reqs)

    # ------------------------------------------------------------------ generate

    def generate(self, prompts: Sequence[Encoded], params: Sequence[SamplingParams],
                 use_tqdm: bool = False) -> list[RequestOutput]:
        added: list[Request] = []
        try:
            for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
                try:
                    added.append(self.engine.add_request(None, ids, sp, prompt=text))
                except ValueError as exc:
                    raise ValueError(f"prompts[{i}]: {exc}") from None
        except BaseException:
            for req in added:
                self.engine.abort_request(req.request_id)
            raise
        return self._run(added, use_tqdm)

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="Processed prompts")
        wanted = {r.request_id for r in requests}
        try:
            while len(final) < len(requests) and self.engine.has_unfinished():
                for out in self.engine.step(finished_only=True):
                    if out.finished and out.request_id in wanted and out.request_id not in final:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            # An interrupted call (Ctrl-C, a crash) must not leave its requests queued.
            for req in requests:
                self.engine.abort_request(req.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        # A request finished outside this loop (aborted, or stepped by a suspended stream)
        # reports its state as it ended.
        return [final.get(r.request_id) or build_output(r, self.engine.tokenizer)
                for r in requests]

    def stream(self, text: str | None, ids: list[int], params: SamplingParams
               ) -> Iterator[RequestOutput]:
        # Queued on the first next(), so an iterator that is never started leaves nothing.
        req = self.engine.add_request(None, ids, params, prompt=text)
        rid = req.request_id
        try:
            while not req.finished:
                outs = self.engine.step()
                for out in outs:
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
                if req.finished:
                    # Finished by someone else's step (a generate() call while this stream
                    # was suspended) or aborted: report the end instead of waiting for it.
                    yield build_output(req, self.engine.tokenizer)
                    return
        finally:
            self.engine.abort_request(rid)
