"""Programmatic dependent launch (``epserve/kernels/triton/pdl.py``) changes no token (skipped
without a GPU of compute capability 9 or more, where it is on).

The same requests, greedy and seeded-random, batch sizes on and between the graphs' rungs, run
by an engine built with PDL on and one built with ``EPSERVE_PDL=0``: the tokens are equal, for
a Qwen3-MoE and a gated-DeltaNet hybrid (their decode graphs, lookahead and prefill included).
A kernel that read its inputs before ``gdc_wait`` would race the kernel before it and break
the equality (run to run, not always: the equality is necessary, not sufficient; the CPU test
``tests/cpu/test_pdl.py`` reads every kernel's guard).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from epserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of compute capability 9 or more (PDL)")


def _requests(n: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randrange(3, 40))]}
               for _ in range(n)]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, seed=i,
                             max_tokens=6 + 5 * (i % 3), ignore_eos=True) for i in range(n)]
    return prompts, params


def _run(ckpt, pdl: str, monkeypatch) -> list[list[int]]:
    from epserve.kernels.triton import pdl as pdl_mod

    monkeypatch.setenv("EPSERVE_PDL", pdl)
    pdl_mod.pdl_device.cache_clear()
    try:
        llm = LLM(model=str(ckpt), dtype="bfloat16", device="cuda", num_kv_blocks=512,
                  max_num_seqs=32)
        assert pdl_mod.pdl_device() is (pdl == "1")
        out = []
        for n, seed in ((1, 3), (5, 4), (8, 5)):
            prompts, params = _requests(n, seed)
            out += [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    finally:
        pdl_mod.pdl_device.cache_clear()
        gc.collect()
        torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_pdl_changes_no_token(arch, tmp_path, monkeypatch):
    from tiny_ckpt import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(arch, tmp_path / arch)
    on = _run(ckpt, "1", monkeypatch)
    off = _run(ckpt, "0", monkeypatch)
    assert on == off and len(on) == 14 and all(len(t) >= 6 for t in on)
