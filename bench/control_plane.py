"""Control-plane cost of one engine step on the CPU, the forward excluded, through the one
execution path every ep_size runs.

Brings 256 sequences into decode on a tiny random one-rank model (real StepModel, Scheduler,
KV book), then times, over many steps, what the head and rank 0 do around a forward: the
scheduler's plan, the step command (``StepModel.build_command``), and rank 0 admitting it
(validate, apply, this rank's rows, the flattened inputs: token ids, positions, KV slots, block
tables). With one rank the command is handed over as an object; what encoding it would cost
under EP is timed separately and not part of the step. The forward, sampling and output
processing run untimed, so sequences grow and cross block boundaries as in real serving.
Prints a table last.

    python bench/control_plane.py [--seqs 256] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from epserve.head.engine import Engine, EngineConfig
from epserve.head.sampling_params import SamplingParams
from epserve.head.scheduler import SchedulerConfig
from epserve.worker.runner_config import RunnerConfig
from epserve.worker.step_command import encode
from epserve.worker.step_model import StepModel


class _NoText:
    def decode(self, ids, skip_special_tokens=True):
        return ""


def _tiny_config(folder: Path) -> None:
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512,
        "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "norm_topk_prob": True, "tie_word_embeddings": False, "torch_dtype": "float32"}))


class _TimedChannel:
    """Rank 0's channel with its host half timed (and the frame's encoding, aside)."""

    def __init__(self, rank0, record: dict[str, list[float]]):
        self.rank0, self.record = rank0, record

    def run(self, cmd):
        t0 = time.perf_counter()
        admitted = self.rank0.admit(cmd)
        t1 = time.perf_counter()
        encode(cmd)
        t2 = time.perf_counter()
        self.record["admit"].append(t1 - t0)
        self.record["encode"].append(t2 - t1)
        return [self.rank0.execute(cmd, *admitted)]


def _timed(record: list[float], fn):
    def wrapped(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        record.append(time.perf_counter() - t)
        return out
    return wrapped


def run(num_seqs: int, steps: int, prompt_len: int) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp())
    _tiny_config(folder)
    model = StepModel.one_rank(RunnerConfig(model=str(folder), device="cpu",
                                            load_format="dummy", max_num_seqs=num_seqs,
                                            num_kv_blocks=num_seqs * 64))
    engine = Engine(model, _NoText(), EngineConfig(
        max_model_len=4096, vocab_size=512,
        scheduler=SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=8192)))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(None, [(i * 7 + j) % 500 + 3 for j in range(prompt_len)], params)
    while any(not s.output_ids for s in engine.scheduler.waiting) or any(
            not s.output_ids for s in engine.scheduler.running):
        engine.step()
    rec: dict[str, list[float]] = {"plan": [], "command": [], "admit": [], "encode": []}
    sched = engine.scheduler
    sched.schedule = _timed(rec["plan"], sched.schedule)  # instance attributes: timers only
    model.build_command = _timed(rec["command"], model.build_command)
    model.channel = _TimedChannel(model.rank0, rec)
    for _ in range(steps):
        engine.advance()  # the serving loop's step (AsyncEngine): no output objects built
        assert len(sched.running) == num_seqs
    total = [a + b + c for a, b, c in zip(rec["plan"], rec["command"], rec["admit"])]
    med = {k: statistics.median(v) * 1e6 for k, v in rec.items()}
    med["step"] = statistics.median(total) * 1e6
    return med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=32)
    args = ap.parse_args(argv)
    r = run(args.seqs, args.steps, args.prompt_len)
    print("\n(median us per step; step = plan + command + admit; encode: what the frame would "
          "cost under EP, not part of a one-rank step)")
    print("| running seqs | steps | plan | command | admit (validate, apply, inputs) | "
          "step | encode (EP only) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.seqs} | {args.steps} | {r['plan']:.1f} | {r['command']:.1f} | "
          f"{r['admit']:.1f} | {r['step']:.1f} | {r['encode']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
