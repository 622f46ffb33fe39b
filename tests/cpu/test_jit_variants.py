"""What a serving workload compiles after start-up, counted as bench/jit_variants.py counts it
(each Triton launch's specialization key, on CPU under the interpreter, in a fresh process):
requests arriving one a step, so steps mix decode rows with prompt chunks of many sizes, rows
greedy and random, with logprobs, with 1-4 stop ids banned under min_tokens. After the start-up
warm-up and the decode rungs nothing is new: on a GPU the first requests wait for no compile.
(On the GPU itself: tests/gpu/test_warmup_gpu.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_staggered_workload_meets_no_variant_the_start_up_did_not_compile():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "jit_variants.py"), "--prompts", "6", "--budget",
         "96", "--max-prompt", "60", "--max-tokens", "3", "--max-num-seqs", "8"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout.strip().splitlines()
    assert "| _moe_gemm_kernel |" in out.stdout  # the CUDA path's kernels did run
    assert table[-1] == "variants compiled while serving: 0", out.stdout[-2000:]
