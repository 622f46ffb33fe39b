"""What the serving loop's engine thread spends per step on outputs, the forward excluded.

Runs the built-in demo model (its real tokenizer) in an ``AsyncEngine`` in this process with one
client ``Outbox`` (as an ingress replica has), submits ``--seqs`` requests at once and reads
their delta records until every one finished. Times, per step: the engine's output processing
(``Engine._apply``: append each token, detokenize it, check stops and grammars) and the hand-over
(``AsyncEngine._deliver``: one delta record per request, one wake-up per event loop) and the
snapshot /metrics reads (``AsyncEngine._publish``), next to
the whole step (``Engine.advance``) and its forward. On the GPU the forward shrinks and these
stay: they are what a 256-row decode step costs the head's CPU. Prints a table last.

    python bench/head_outputs.py [--seqs 256] [--input-len 64] [--output-len 32]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time

import torch

from epserve.cluster.engine_args import EngineArgs, build_engine
from epserve.head.async_engine import AsyncEngine, Outbox
from epserve.head.sampling_params import SamplingParams
from epserve.models.demo import demo_model_path


def _timed(obj, name: str, record: list[float]) -> None:
    fn = getattr(obj, name)

    def wrapped(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - t)

    setattr(obj, name, wrapped)  # an instance attribute: a timer only


async def _serve(ae: AsyncEngine, n: int, input_len: int, output_len: int) -> int:
    box, rnd = Outbox("bench"), random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(n):
        ae.submit(box, f"r{i}", [rnd.randrange(3, 500) for _ in range(input_len)], params)
    done = records = 0
    while done < n:
        out = await box.take(1.0)
        records += len(out)
        done += sum(1 for r in out if r[1])
    return records


def run(n: int, input_len: int, output_len: int) -> dict[str, float]:
    torch.set_num_threads(1)
    engine, runner, _ = build_engine(EngineArgs(model=str(demo_model_path()), device="cpu",
                                                max_num_batched_tokens=max(8192, n * input_len)))
    ae = AsyncEngine(engine)
    rec: dict[str, list[float]] = {"apply": [], "deliver": [], "publish": [], "forward": [],
                                   "step": []}
    _timed(engine, "_apply", rec["apply"])
    _timed(ae, "_deliver", rec["deliver"])
    _timed(ae, "_publish", rec["publish"])
    _timed(engine, "advance", rec["step"])
    _timed(runner.rank0.runner, "_forward", rec["forward"])
    try:
        records = asyncio.run(_serve(ae, n, input_len, output_len))
    finally:
        ae.shutdown()
    assert records >= n, f"{records} records for {n} requests"
    # the decode steps with every row running: the first (prefill) and the last few left out
    return {k: statistics.median(v[2:-2]) * 1e3 for k, v in rec.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args(argv)
    r = run(args.seqs, args.input_len, args.output_len)
    print("\n(median ms per decode step; apply: output processing, deliver: the hand-over)")
    print("| rows | apply | deliver | publish | apply + deliver per row (us) | step | forward |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    per_row = (r["apply"] + r["deliver"]) / args.seqs * 1e3
    print(f"| {args.seqs} | {r['apply']:.2f} | {r['deliver']:.2f} | {r['publish']:.3f} | "
          f"{per_row:.1f} | {r['step']:.1f} | {r['forward']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
