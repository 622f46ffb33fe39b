"""The ingress's own CPU per streamed SSE chunk, Ray Serve and HTTP excluded.

Drives the real ``OpenAIServing`` and ``EngineClient`` (the demo model's tokenizer) in this
process against a synthetic head: each ``poll`` is an engine step that gives every live request
one token (text decoded beforehand, so the head costs almost nothing). ``--requests`` streaming
completions run at once; the process CPU time over the run divided by the SSE chunks they got
is what one chunk costs this side: the channel's records applied, the delta, the chunk's JSON,
the /metrics observations, the asyncio hand-offs; the heap built before the run is frozen out of
the collector, as a replica's is. Prints a table last.

    python bench/ingress_chunk.py [--requests 256] [--output-len 64] [--endpoint completions]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from transformers import AutoTokenizer

from epserve.cluster.cpu_threads import freeze_heap
from epserve.deploy.engine_client import EngineClient
from epserve.deploy.metrics import ServerMetrics
from epserve.deploy.serving import ModelInfo, OpenAIServing
from epserve.head.limits import RequestLimits
from epserve.head.output_stream import Submission, encode_records
from epserve.models.demo import demo_model_path


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class StepHead:
    """The HeadActor's submit / poll / abort_many, one token per live request per poll."""

    def __init__(self, texts: list[str], output_len: int):
        self.texts, self.output_len = texts, output_len
        self.sent: dict[str, int] = {}
        self.submit, self.poll = _Method(self._submit), _Method(self._poll)
        self.abort_many = _Method(self._abort)

    async def _submit(self, client_id: str, requests: list[list]) -> list[None]:
        for wire in requests:
            self.sent[Submission.from_wire(wire).request_id] = 0
        return [None] * len(requests)

    async def _abort(self, client_id: str, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.sent.pop(rid, None)

    async def _poll(self, client_id: str, wait_s: float) -> bytes:
        await asyncio.sleep(0)  # the readers run between steps, as they would
        records = []
        for rid, n in list(self.sent.items()):
            n += 1
            t = 3 + (n * 7) % (len(self.texts) - 3)
            done = n >= self.output_len
            records.append([rid, done, None, 0, None,
                            [[0, [t], self.texts[t], None, "length" if done else None, None]]])
            if done:
                del self.sent[rid]
            else:
                self.sent[rid] = n
        return encode_records(records)


async def run(requests: int, output_len: int, endpoint: str) -> dict[str, float]:
    tok = AutoTokenizer.from_pretrained(str(demo_model_path()))
    texts = [tok.decode([t]) for t in range(tok.vocab_size)]
    client = EngineClient(StepHead(texts, output_len), decode=lambda t: texts[t])
    info = ModelInfo(name="demo", path="demo", max_model_len=4096, vocab_size=tok.vocab_size,
                     limits=RequestLimits(), prefix_caching=True)
    serving = OpenAIServing(client, tok, info,
                            ServerMetrics("demo", {"enable_prefix_caching": "True"}, 4096))
    freeze_heap()  # as a replica does once built (deploy/app.py)
    chunks = 0

    async def one(i: int) -> None:
        nonlocal chunks
        body = {"model": "demo", "max_tokens": output_len, "stream": True, "ignore_eos": True,
                "temperature": 0}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": f"hello {i}"}]
            sse = await serving.chat(body)
        else:
            body["prompt"] = [3 + i % 100] * 32
            sse = await serving.completions(body)
        async for _ in sse:
            chunks += 1

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(one(i) for i in range(requests)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"chunks": chunks, "wall": wall, "cpu": cpu, "polls": client.polls}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    args = ap.parse_args(argv)
    r = asyncio.run(run(args.requests, args.output_len, args.endpoint))
    print("\n| endpoint | requests | chunks | polls | CPU s | CPU per chunk (us) |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| {args.endpoint} | {args.requests} | {r['chunks']} | {r['polls']} | "
          f"{r['cpu']:.2f} | {r['cpu'] / r['chunks'] * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
