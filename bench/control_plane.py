"""Control-plane cost of one engine step on the CPU, the forward excluded.

Brings 256 sequences into decode on a tiny random model (real Runner, real Scheduler), then
times, over many steps, what the head and the rank do around a forward: the scheduler's plan
plus building the step's inputs (rows, token ids, positions, KV slots, block tables). The
forward, sampling and output processing run untimed between measurements, so sequences grow
and cross block boundaries as in real serving. Prints a table last.

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
from epserve.worker.runner import Runner, RunnerConfig


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


def run(num_seqs: int, steps: int, prompt_len: int) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp())
    _tiny_config(folder)
    runner = Runner(RunnerConfig(model=str(folder), device="cpu", load_format="dummy",
                                 max_num_seqs=num_seqs, num_kv_blocks=num_seqs * 64))
    engine = Engine(runner, _NoText(), EngineConfig(
        max_model_len=4096, vocab_size=512,
        scheduler=SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=8192)))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(None, [(i * 7 + j) % 500 + 3 for j in range(prompt_len)], params)
    while any(not s.output_ids for s in engine.scheduler.waiting) or any(
            not s.output_ids for s in engine.scheduler.running):
        engine.step()
    sched = engine.scheduler
    plan_t, build_t = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        inp = runner.prepare_step(plan.decode_tokens, [s.state for s in plan.decode],
                                  plan.slices)
        t2 = time.perf_counter()
        assert len(plan.decode) == num_seqs and not plan.slices
        engine._apply(plan, runner.execute_step(inp), {})
        plan_t.append(t1 - t0)
        build_t.append(t2 - t1)
    total = [a + b for a, b in zip(plan_t, build_t)]
    return {"plan_us": statistics.median(plan_t) * 1e6,
            "build_us": statistics.median(build_t) * 1e6,
            "step_us": statistics.median(total) * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt-len", type=int, default=32)
    args = ap.parse_args(argv)
    r = run(args.seqs, args.steps, args.prompt_len)
    print(f"\n| running seqs | steps | plan (median us) | build inputs (median us) | "
          f"plan + build (median us) |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {args.seqs} | {args.steps} | {r['plan_us']:.1f} | {r['build_us']:.1f} | "
          f"{r['step_us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
