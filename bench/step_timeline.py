"""Where a decode step's wall time goes on the device: busy, idle, in the graph or outside it.

Profiles one generate (torch profiler with CUDA activity), cuts the device timeline into steps
at each device-to-host copy (a step ends in its sampled tokens' copy back), and for the middle
steps reports: the decode graph's kernels (launched by ``cudaGraphLaunch``: count, busy time,
the span they cover), every device op outside the graph (name, the runtime call that queued it,
its duration and the idle time before it), and the device's idle time a step. The step time
``bench/decode_latency.py`` reports is busy + idle; this says which part the host leaves idle
and which ops run beside the graph. The profiler slows the host (each launch is recorded), so
the idle time here overstates the unprofiled step's: read the ops and their device times, and
take step times from ``bench/decode_latency.py``. Prints a table last.

    python bench/step_timeline.py --model-shape qwen3.5-35b-a3b --layers 8 --steps 12
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from epserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from shapes import SHAPES, shape  # noqa: E402

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def device_ops(trace: dict) -> list[dict]:
    """The trace's device ops sorted by start, each with ``api``: the runtime call that queued
    it (matched by correlation id)."""
    api: dict[int, str] = {}
    ops = []
    for e in trace["traceEvents"]:
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            api[args["correlation"]] = e["name"]
        elif cat in DEVICE_CATS and e.get("ph") == "X":
            ops.append(e)
    for e in ops:
        e["api"] = api.get((e.get("args") or {}).get("correlation"), "?")
    ops.sort(key=lambda e: e["ts"])
    return ops


def steps_of(ops: list[dict]) -> list[list[dict]]:
    """The timeline cut after each device-to-host copy."""
    steps, cur = [], []
    for e in ops:
        cur.append(e)
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]:  # "Memcpy DtoH (...)"
            steps.append(cur)
            cur = []
    return steps


def summarize(step: list[dict], prev_end: float) -> dict:
    """Busy and idle microseconds of one step, the graph's share, and the ops outside it."""
    busy = idle = g_busy = 0.0
    g_n, outside = 0, []
    end = prev_end
    for e in step:
        gap = max(0.0, e["ts"] - end)
        idle += gap
        busy += e["dur"]
        end = max(end, e["ts"] + e["dur"])
        if e["api"].startswith("cudaGraphLaunch"):
            g_n += 1
            g_busy += e["dur"]
        else:
            outside.append((e["name"], e["api"], e["dur"], gap))
    return dict(wall=end - prev_end, busy=busy, idle=idle, g_n=g_n, g_busy=g_busy,
                outside=outside, end=end)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-shape", choices=sorted(SHAPES), default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--trace", help="also write the chrome trace here")
    args = ap.parse_args(argv)
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(shape(args.model_shape, args.layers)))
    llm = LLM(model=str(folder), dtype="bfloat16", load_format="dummy", device="cuda",
              max_model_len=2048, num_kv_blocks=1024)
    sp = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)

    def prompts(shift: int) -> list[dict]:
        return [{"prompt_token_ids": [(7 * i + j + shift) % 1000 + 5 for j in range(16)]}
                for i in range(args.batch)]

    llm.generate(prompts(500), sp)  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts(0), sp)
        torch.cuda.synchronize()
    path = args.trace or str(folder / "trace.json")
    prof.export_chrome_trace(path)
    steps = steps_of(device_ops(json.loads(Path(path).read_text())))
    # the middle steps: past the prefill and the first decode steps, before the last
    lo, hi = min(3, len(steps) - 1), max(min(3, len(steps) - 1) + 1, len(steps) - 2)
    sums = []
    prev_end = steps[lo - 1][-1]["ts"] + steps[lo - 1][-1]["dur"] if lo > 0 else steps[0][0]["ts"]
    for st in steps[lo:hi]:
        s = summarize(st, prev_end)
        prev_end = s["end"]
        sums.append(s)
    n = len(sums)
    print(f"\n{len(steps)} device steps (cut at each device-to-host copy); steps {lo}..{hi - 1} "
          f"averaged ({n}); {args.model_shape}, {args.layers} layers, batch {args.batch}")
    agg: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for s in sums:
        for name, api, dur, gap in s["outside"]:
            a = agg[(name[:60], api)]
            a[0] += dur / n
            a[1] += gap / n
            a[2] += 1 / n
    print("\nops outside the graph, per step (in order of total time):")
    print("| op | queued by | calls | us | idle before, us |")
    print("|---|---|---:|---:|---:|")
    for (name, api), (dur, gap, c) in sorted(agg.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
        print(f"| {name} | {api} | {c:.1f} | {dur:.1f} | {gap:.1f} |")
    mean = {k: sum(s[k] for s in sums) / n for k in ("wall", "busy", "idle", "g_n", "g_busy")}
    print("\nper decode step, device time (us; busy sums each op's time, overlaps counted twice):")
    print("| wall | busy | idle | graph kernels | graph busy | outside the graph, busy |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {mean['wall']:.1f} | {mean['busy']:.1f} | {mean['idle']:.1f} | {mean['g_n']:.0f} "
          f"| {mean['g_busy']:.1f} | {mean['busy'] - mean['g_busy']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
