"""What structured output adds to one engine step on the CPU, through the one path.

Brings N sequences into decode on the demo model (its real tokenizer, vocabulary 2048: 64 mask
words a row), each constrained by a grammar that never ends within the run (``[a-z ]+`` with
EOS banned by ``min_tokens``), then times per step: the head's grammar work (advancing each
matcher with its token and refilling its mask, ``head.grammar``), the step command
(``build_command``, which gathers the masks), rank 0 admitting it (the mirror's mask checks,
this rank's mask rows) and the masks applied to the logits. The same run without a constraint
is the baseline. Prints a table.

    python bench/structured_step.py [--seqs 64 256] [--steps 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from epserve import LLM, SamplingParams
from epserve.head import grammar as G
from epserve.models.demo import demo_model_path
from epserve.worker import runner as R


def _timer(sink: list[float], fn):
    def wrapped(*a, **kw):
        t = time.perf_counter()
        out = fn(*a, **kw)
        sink[-1] += time.perf_counter() - t
        return out
    return wrapped


def run(llm: LLM, n: int, steps: int, constrained: bool) -> dict[str, float]:
    engine = llm.engine
    so = {"grammar": "root ::= [a-z ]+"} if constrained else None
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=steps + 64,
                            min_tokens=steps + 32, structured_outputs=so)
    for i in range(n):
        engine.add_request(None, [(i * 7 + j) % 500 + 3 for j in range(16)], params)
    while any(not s.output_ids for q in (engine.scheduler.waiting, engine.scheduler.running)
              for s in q):
        engine.advance()
    rec: dict[str, list[float]] = {k: [] for k in ("grammar", "command", "admit", "mask")}
    saved = (G.SeqGrammar.accept, G.SeqGrammar.fill, R.apply_token_masks,
             engine.model.build_command, engine.model.rank0.admit)
    G.SeqGrammar.accept = _timer(rec["grammar"], saved[0])
    G.SeqGrammar.fill = _timer(rec["grammar"], saved[1])
    R.apply_token_masks = _timer(rec["mask"], saved[2])
    engine.model.build_command = _timer(rec["command"], saved[3])
    engine.model.rank0.admit = _timer(rec["admit"], saved[4])
    try:
        for _ in range(steps):
            for v in rec.values():
                v.append(0.0)
            engine.advance()
            assert len(engine.scheduler.running) == n
    finally:
        G.SeqGrammar.accept, G.SeqGrammar.fill, R.apply_token_masks = saved[:3]
        del engine.model.build_command, engine.model.rank0.admit
        for rid in list(engine.requests):
            engine.abort_request(rid)
        engine.advance()
    return {k: statistics.median(v) * 1e6 for k, v in rec.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args(argv)
    path = demo_model_path(cache_dir=tempfile.gettempdir() + "/epserve-bench", progress=False)
    llm = LLM(model=str(path), dtype="float32", seed=0, max_num_seqs=max(args.seqs),
              decode_lookahead=False)
    rows = []
    for n in args.seqs:
        for constrained in (False, True):
            rows.append((n, constrained, run(llm, n, args.steps, constrained)))
    print("\n(median us per step)")
    print("| rows | constrained | head grammar (accept + fill) | command | admit | mask apply |")
    print("|---:|---|---:|---:|---:|---:|")
    for n, c, r in rows:
        print(f"| {n} | {'yes' if c else 'no'} | {r['grammar']:.1f} | {r['command']:.1f} | "
              f"{r['admit']:.1f} | {r['mask']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
