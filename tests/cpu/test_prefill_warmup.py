"""The start-up warm-up (run on CUDA to compile the kernels a step can launch before the first
request): prefill forwards of a full step and of every smaller step size at which the routed
experts change kernel variant, then sampling; it must leave the KV cache untouched and the
engine's answers unchanged. (What a workload still compiles after it: bench/jit_variants.py.)"""

from __future__ import annotations

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.kernels.moe import token_classes
from epserve.worker.warmup import warm_up_prefill, warmup_token_counts


def test_warm_up_writes_no_kv_and_changes_no_output(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", max_model_len=40,
              max_num_batched_tokens=96)
    r = llm.model.runner
    assert r.cfg.warmup_tokens == 96  # the engine asks for one full step
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = llm.generate([{"prompt_token_ids": [5, 9, 11, 3]}], greedy)[0].outputs[0].token_ids
    caches = [(k.clone(), v.clone()) for k, v in r.kv_caches]
    def warm(n):  # what the runner runs at start on CUDA
        return warm_up_prefill(r._forward, r.model.compute_logits, n, r.max_model_len,
                               r.block_size, r.device)

    hidden = warm(96)  # 2 prompts of 39 tokens and one of 18 (max_model_len 40)
    assert hidden.shape == (96, r.model_config.hidden_size)
    assert torch.isfinite(hidden).all()
    r.warm_up()  # every size class, then sampling
    for (k0, v0), (k1, v1) in zip(caches, r.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    after = llm.generate([{"prompt_token_ids": [5, 9, 11, 3]}], greedy)[0].outputs[0].token_ids
    assert after == before
    with pytest.raises(ValueError, match="num_tokens"):
        warm(0)


def test_warm_up_covers_every_launch_class_of_the_routed_experts(qwen3_ckpt):
    """The step sizes warmed are the full step, then the first size of each of the MoE's
    launch classes below it; a step of any size up to the full one shares its class with one
    of them."""
    from epserve.kernels.triton.fused_moe import launch_class

    r = LLM(model=str(qwen3_ckpt), dtype="float32", max_num_batched_tokens=512).model.runner
    moe = next(m for m in r.model.modules() if hasattr(m, "warmup_token_counts"))
    w13, k = moe.experts.w13, moe.gate.top_k
    sizes = warmup_token_counts(r.model, 512)
    assert sizes[0] == 512 and sizes[1:] == sorted(sizes[1:], reverse=True)
    assert len(sizes) >= 3  # the tiny model's 8 experts: several tile regimes below 512 tokens

    def cls(t):
        e, two_i, h = w13.shape
        return launch_class(t * k, e, h, two_i // 2, w13.element_size())

    warmed = {cls(t) for t in sizes}
    assert all(cls(t) in warmed for t in range(1, 513))  # checked size by size
    assert set(token_classes(512, k, w13)) - {512} <= set(sizes)
