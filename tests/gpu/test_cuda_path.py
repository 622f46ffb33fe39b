"""The CUDA path (skipped without a GPU): fp32 on the GPU equals transformers; bf16 on the GPU
agrees with the CPU fp32 path on >= 99% of the first 64 greedy tokens over 32 prompts."""

from __future__ import annotations

import random

import pytest
import torch

from epserve import LLM, SamplingParams
from oracle import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW = 64


def _prompts(n: int = 32, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 48))] for _ in range(n)]


def _greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_fp32_on_cuda_matches_transformers(tiny_ckpt):
    prompts = _prompts(8)
    llm = LLM(model=str(tiny_ckpt), dtype="float32", device="cuda", num_kv_blocks=2048)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(32))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_ckpt, p, 32)[0]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def bf16_ckpt(request, tmp_path_factory):
    """The tiny checkpoint saved in bf16: the fp32 CPU run and the bf16 GPU run read the same
    weights, so what differs is only the arithmetic."""
    from tiny_ckpt import make_tiny_checkpoint

    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param),
                                dtype=torch.bfloat16)


def _agreement(ref, got) -> tuple[int, int]:
    same = total = 0
    for a, b in zip(ref, got):
        for x, y in zip(a, b):
            same += x == y
            total += 1
    return same, total


def _hf_greedy(path, prompts, dtype, device) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=NEW, min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def test_bf16_on_cuda_agrees_with_cpu_fp32(bf16_ckpt):
    prompts = _prompts()
    ref = LLM(model=str(bf16_ckpt), dtype="float32", device="cpu").generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy())
    got = LLM(model=str(bf16_ckpt), dtype="bfloat16", device="cuda",
              num_kv_blocks=2048).generate([{"prompt_token_ids": p} for p in prompts], _greedy())
    same, total = _agreement([o.outputs[0].token_ids for o in ref],
                             [o.outputs[0].token_ids for o in got])
    # control: transformers bf16 vs its own fp32 on the same checkpoint and prompts
    hs, ht = _agreement(_hf_greedy(bf16_ckpt, prompts[:8], torch.float32, "cpu"),
                        _hf_greedy(bf16_ckpt, prompts[:8], torch.bfloat16, "cuda"))
    print(f"bf16 cuda vs fp32 cpu: {same}/{total} = {same / total:.4f}; transformers bf16 cuda "
          f"vs fp32 cpu (8 prompts): {hs}/{ht}")
    assert same / total >= 0.99
