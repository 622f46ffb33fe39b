"""RemoteEngine: the offline API's view of an engine that runs in a HeadActor (EP over Ray).

An ``LlmBackend`` (``llm_backend.py``), beside the in-process ``LocalBackend``; its
``worker_failures``, ``worker_handles`` and ``inject_command_fault`` are no part of that
protocol: they are for tests of the EP ranks (``llm.backend.worker_handles()``).

Invariants: what crosses to the head is plain data (token ids, sampling fields as a dict);
a request the head refuses raises a plain ``ValueError`` here with the head's message, and an
engine that cannot serve any more raises a plain ``EngineDead`` (never a Ray traceback);
``close`` shuts the head and its EP ranks down, and is safe to call twice.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Iterator, Sequence

from epserve.cluster.engine_args import EngineArgs, load_tokenizer
from epserve.head.async_engine import EngineDead
from epserve.head.output_stream import (
    OutputAccumulator, Submission, decode_records, snapshot,
)
from epserve.head.outputs import RequestOutput
from epserve.head.sampling_params import SamplingParams
from epserve.models.traits import BeamReq, CapabilityAbsent


def _plain(exc: BaseException) -> BaseException:
    """The exception a Ray task raised, without Ray's wrapper."""
    return getattr(exc, "cause", None) or exc


class RemoteEngine:
    """Drives a HeadActor started for these resolved ``args`` (one per ``LLM``)."""

    #: the engine and its model run in the HeadActor and its EP ranks, not here
    engine = None
    model = None

    def __init__(self, args: EngineArgs):
        import ray

        from epserve.cluster.bringup import start_head

        self.name = f"epserve-llm-{uuid.uuid4().hex[:8]}"
        self.head = start_head(args, name=self.name, detached=False)  # ValueError: why not
        self.info = ray.get(self.head.ready.remote())
        self._ids = 0
        self._caps = frozenset(self._call(self.head.capabilities.remote()))
        self.tokenizer = load_tokenizer(str(args.model), args.tokenizer)

    def _call(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ValueError as exc:
            raise ValueError(str(_plain(exc))) from None
        except EngineDead as exc:  # Ray's RayTaskError(EngineDead): the head's own error
            raise EngineDead(str(_plain(exc))) from None
        except ray.exceptions.RayActorError:
            raise EngineDead("the engine's head actor is gone") from None

    def check_request(self, ids: list[int], params: SamplingParams) -> None:
        """Nothing here: the head checks every request of a call before it runs any, and its
        ``ValueError`` reaches the caller as a plain one."""

    def generate(self, prompts: Sequence[tuple[str | None, list[int]]],
                 params: Sequence[SamplingParams], use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        reqs = [{"prompt": text, "prompt_token_ids": ids, "params": dataclasses.asdict(sp)}
                for (text, ids), sp in zip(prompts, params)]
        return self._call(self.head.generate_batch.remote(reqs))

    def stream(self, text: str | None, ids: list[int], params: SamplingParams
               ) -> Iterator[RequestOutput]:
        """The request's cumulative output after each step that changed it, over the head's
        client channel (submit, then poll for delta records)."""
        import ray

        tokenizer = self.tokenizer
        self._ids += 1
        rid = f"{self.name}-stream-{self._ids}"
        decode = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) \
            if tokenizer is not None else (lambda t: "")
        acc = OutputAccumulator(rid, text, list(ids), params.n, params.logprobs is not None,
                                decode)
        sub = Submission(rid, list(ids), dataclasses.asdict(params), text)
        (error,) = self._call(self.head.submit.remote(self.name, [sub.to_wire()]))
        if error is not None:
            raise ValueError(error)
        finished = False
        try:
            while not finished:
                frame = self._call(self.head.poll.remote(self.name, 1.0))
                changed = False
                for rec in decode_records(frame):
                    if rec[0] == rid:
                        acc.apply(rec)
                        changed = True
                if changed:
                    finished = acc.output.finished
                    yield snapshot(acc.output)
        finally:
            if not finished:
                ray.get(self.head.abort_many.remote(self.name, [rid]))

    def stats(self) -> dict[str, Any]:
        return self._call(self.head.stats.remote())

    def health(self) -> dict[str, Any]:
        return self._call(self.head.health.remote())

    def worker_failures(self) -> list[list[dict[str, Any]]]:
        return self._call(self.head.worker_failures.remote())

    def worker_handles(self) -> list[Any]:
        return self._call(self.head.worker_handles.remote())

    def inject_command_fault(self, kind: str) -> None:
        self._call(self.head.inject_command_fault.remote(kind))

    def capabilities(self) -> frozenset[str]:
        return self._caps

    def beam_search(self, reqs: Sequence[BeamReq]) -> list[list[int]]:
        raise CapabilityAbsent("beam search is not implemented over expert parallelism")

    def close(self) -> None:
        from epserve.cluster.bringup import stop_head

        if self.head is not None:
            stop_head(self.name)
            self.head = None

