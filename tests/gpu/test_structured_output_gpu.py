"""Structured output on CUDA (skipped without a GPU): the packed token masks applied to device
logits allow exactly the tokens the CPU path allows (same sampled tokens for the same logits,
greedy and seeded rows mixed with unconstrained ones), and the demo model served on CUDA
(decode graphs, the decode lookahead) gives outputs that match their JSON schema, regex and
choice, and the same constrained text as on the CPU."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

V = 1000


def test_masks_allow_the_same_tokens_on_cuda_and_cpu():
    from epserve.kernels.token_mask import apply_token_masks
    from epserve.models.traits import RowSampling
    from epserve.worker.sampler import sample_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, V, generator=g) * 4
    allowed = [torch.randperm(V, generator=g)[:n] for n in (1, 3, 50, 999)]
    words = np.zeros((4, -(-V // 32)), dtype=np.uint32)
    for r, ids in enumerate(allowed):
        for t in ids.tolist():
            words[r, t // 32] |= np.uint32(1 << (t % 32))
    words = words.view(np.int32)  # the packed masks' int32 words
    mask_rows = np.array([0, 2, 5, 7], dtype=np.int64)
    rows = [RowSampling(temperature=0.0 if i % 2 else 1.0, seed=i, logprobs=1) for i in range(8)]
    got = {}
    for dev in ("cpu", "cuda"):
        logits = x.clone().to(dev)
        apply_token_masks(logits, mask_rows, words)
        got[dev] = sample_rows(logits, rows, list(range(8)))
    assert [t.token_id for t in got["cuda"]] == [t.token_id for t in got["cpu"]]
    for r, ids in zip(mask_rows.tolist(), allowed):
        assert got["cuda"][r].token_id in set(ids.tolist())


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}}, "required": ["n"]}


def test_constrained_outputs_match_on_cuda(demo_model_dir):
    import jsonschema

    from epserve import LLM, SamplingParams
    from epserve.head.structured_params import StructuredOutputsParams

    # compact JSON: under free whitespace the random model spends its 60 tokens on blanks
    kinds = [StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
             StructuredOutputsParams(regex=r"[a-z]{2,5}-\d\d"),
             StructuredOutputsParams(choice=["red", "green", "blue"])]
    sp = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=k) for k in kinds]
    prompts = ["Answer:"] * len(kinds)
    texts = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model=str(demo_model_dir), dtype="float32", device=device, seed=0)
        texts[device] = [o.outputs[0].text for o in llm.generate(prompts, sp)]
    js, rx, ch = texts["cuda"]
    jsonschema.validate(json.loads(js), SCHEMA)
    assert re.fullmatch(r"[a-z]{2,5}-\d\d", rx) and ch in ("red", "green", "blue")
    assert texts["cuda"] == texts["cpu"]
