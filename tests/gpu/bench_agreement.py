"""Teacher-forced argmax agreement of epserve bf16 (CUDA) and transformers bf16 (CUDA) with a
reference continuation (helper for test_cuda_path.py)."""

from __future__ import annotations

import torch

from epserve import LLM, SamplingParams


def teacher_forced(path: str, prompts: list[list[int]], ref: list[list[int]]) -> tuple[int, int, int]:
    """(epserve matches, transformers matches, positions): at each position i of ``ref[j]``,
    whether the argmax given ``prompts[j] + ref[j][:i]`` is ``ref[j][i]``."""
    from transformers import AutoModelForCausalLM

    gpu = LLM(model=path, dtype="bfloat16", device="cuda", num_kv_blocks=2048)
    outs = gpu.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, ref)],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    ours = 0
    for p, r, o in zip(prompts, ref, outs):
        for i, t in enumerate(r):
            entry = o.prompt_logprobs[len(p) + i]
            ours += max(entry.items(), key=lambda kv: kv[1].logprob)[0] == t
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    theirs = 0
    with torch.inference_mode():
        for p, r in zip(prompts, ref):
            logits = m(torch.tensor([p + r], device="cuda")).logits[0]
            pred = logits[len(p) - 1:len(p) - 1 + len(r)].argmax(-1).tolist()
            theirs += sum(x == y for x, y in zip(pred, r))
    return ours, theirs, sum(len(r) for r in ref)
