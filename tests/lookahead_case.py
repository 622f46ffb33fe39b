"""The decode-lookahead tests' common case: random prompts, and one workload generated with the
lookahead off then on (tests/cpu/test_decode_lookahead.py, tests/cpu/test_hybrid_lookahead.py)."""

from __future__ import annotations

import random

from epserve import LLM


def random_prompts(n: int, seed: int = 5) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randrange(3, 12))]}
            for _ in range(n)]


def off_and_on(ckpt, prompts, params, **kw):
    """Token ids (and logprobs) of each request, lookahead off then on, plus the on-run's LLM."""
    out = []
    for lookahead in (False, True):
        llm = LLM(model=str(ckpt), dtype="float32", device="cpu", decode_lookahead=lookahead,
                  **kw)
        res = llm.generate(prompts, params)
        out.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason,
                     [None if lp is None else sorted(lp.items()) for lp in
                      (o.outputs[0].logprobs or [])]) for o in res])
    return out[0], out[1], llm


def fed_another_token(model) -> tuple:
    """A trait caller (``LLM.model``) feeds a token other than the one sampled: prefill, decode
    the sampled token (its successor's forward is queued), decode another token (the queued
    forward is dropped), then decode the sampled one (queued again, and taken). The tokens."""
    seq = model.alloc_sequence()
    prompt = [5, 17, 33, 41]
    assert model.reserve_blocks(seq, len(prompt) + 4)
    first = model.prefill(prompt, seq).token_id
    second = model.decode(first, seq).token_id  # queues the forward of `second`
    other = (second + 1) % model.vocab_size()
    third = model.decode(other, seq).token_id  # drops it
    return first, second, third, model.decode(third, seq).token_id, list(seq.tokens)
