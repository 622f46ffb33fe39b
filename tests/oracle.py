"""The oracle: Hugging Face transformers running the same checkpoint in fp32 on the CPU."""

from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=4)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                             attn_implementation="eager")
    return m.eval()


@torch.inference_mode()
def hf_greedy(path: str | Path, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy continuation and each new token's logprob, EOS ignored."""
    m = hf_model(str(path))
    ids = torch.tensor([prompt])
    out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                     max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                     eos_token_id=None, pad_token_id=0, output_logits=True,
                     return_dict_in_generate=True)
    new = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(out.logits, new)]
    return new, lps


@torch.inference_mode()
def hf_prompt_logprobs(path: str | Path, prompt: list[int], k: int = 0
                       ) -> list[tuple[float, list[tuple[int, float]]]]:
    """For positions 1..n-1: logprob of prompt[i] given prompt[:i], and the top-k."""
    m = hf_model(str(path))
    logits = m(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    res = []
    for i in range(1, len(prompt)):
        row = lp[i - 1]
        top = torch.topk(row, k) if k else None
        res.append((row[prompt[i]].item(),
                    list(zip(top.indices.tolist(), top.values.tolist())) if k else []))
    return res
