"""After start-up on CUDA, serving compiles no Triton kernel: the warm-up (a prefill forward of
each step size class, then sampling) and the decode graphs' capture compiled every variant the
steps of a workload can launch, so the first requests after a deploy wait for no compile.

The workload arrives as over HTTP (a burst, then a request every step), so its steps mix decode
rows with prompt chunks of many sizes, greedy and random rows with top-p and logprobs. Run in a
fresh process: Triton's in-process kernel cache is shared by every engine of a process, so an
earlier test's engine would have compiled the variants already. Triton's ``jit_cache_hook``
fires for every variant a process meets first (before the on-disk cache is read).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

# on CPU no Triton kernel is launched, so "none compiled" would hold by construction
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SCRIPT = textwrap.dedent("""
    import json, random, sys
    from triton import knobs
    from epserve import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], dtype="bfloat16", max_num_batched_tokens=256, max_num_seqs=32,
              max_model_len=512, num_kv_blocks=256)
    compiled = []

    def hook(*args, **kwargs):
        compiled.append(kwargs["repr"].split("(")[0])
        return False  # compile it

    knobs.runtime.jit_cache_hook = hook
    rng = random.Random(0)
    engine, done, n = llm.engine, 0, 40
    for i in range(n + 8):
        if i < n:
            temp = rng.choice([0.0, 0.7])
            prompt = [rng.randrange(3, 300) for _ in range(rng.randrange(2, 200))]
            engine.add_request(f"r{i}", prompt,
                               SamplingParams(temperature=temp, top_p=0.9 if temp else 1.0,
                                              logprobs=1 if i % 3 == 0 else None, max_tokens=6,
                                              ignore_eos=True, seed=i))
        done += sum(o.finished for o in engine.step())
    while done < n:
        done += sum(o.finished for o in engine.step())
    print(json.dumps(compiled))
""")


@pytest.fixture(params=["qwen3_moe", "qwen3_5_moe"])
def ckpt(request, qwen3_ckpt, tmp_path):
    """The tiny Qwen3-MoE, and a tiny hybrid (its prefill on fla-core's kernels)."""
    if request.param == "qwen3_moe":
        return qwen3_ckpt
    from tiny_ckpt import make_tiny_checkpoint

    return make_tiny_checkpoint(request.param, tmp_path / request.param)


def test_a_staggered_workload_compiles_no_kernel_after_start(ckpt):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(ckpt)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    compiled = json.loads(out.stdout.strip().splitlines()[-1])
    assert compiled == [], f"compiled while serving: {compiled}"
