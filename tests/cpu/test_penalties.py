"""Repetition, frequency and presence penalties (vLLM's) through the offline ``LLM``, greedy, on a
tiny random Qwen3-MoE checkpoint, against references run on transformers fp32: its own
``generate(repetition_penalty=...)``, and a step-by-step loop that applies vLLM's formulas to
transformers' logits (repetition on prompt and output tokens, then frequency x count and presence
on output tokens)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.models.traits import RowSampling
from epserve.worker.ep_mirror import EpMirror
from epserve.worker.step_command import NewSeq, StepCommand
from tests.oracle import hf_model

N_NEW = 12


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 60) for _ in range(n)] for n in (7, 20, 3)]


@pytest.fixture(scope="module")
def llm(qwen3_ckpt) -> LLM:
    # 8-token steps: the longer prompts arrive in chunks
    return LLM(model=str(qwen3_ckpt), dtype="float32", seed=0, max_num_batched_tokens=8)


@torch.inference_mode()
def _reference(path, prompt: list[int], pp: float, fp: float, rp: float) -> list[int]:
    m = hf_model(str(path))
    ids = list(prompt)
    for _ in range(N_NEW):
        x = m(torch.tensor([ids])).logits[0, -1].float()
        seen = torch.tensor(sorted(set(ids)))
        sel = x[seen]
        x[seen] = torch.where(sel > 0, sel / rp, sel * rp)
        for t, c in Counter(ids[len(prompt):]).items():
            x[t] -= fp * c + pp
        ids.append(int(x.argmax()))
    return ids[len(prompt):]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, **kw)


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def test_repetition_penalty_equals_transformers_generate(llm, qwen3_ckpt, prompts):
    m = hf_model(str(qwen3_ckpt))
    plain = _run(llm, prompts, _greedy())
    got = _run(llm, prompts, _greedy(repetition_penalty=1.8))
    for p, g in zip(prompts, got):
        ids = torch.tensor([p])
        want = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          repetition_penalty=1.8, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                          eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert g == want
    assert got != plain  # the penalty changed something here


@pytest.mark.parametrize("pp,fp,rp", [(1.5, 0.0, 1.0), (0.0, 1.0, 1.0), (-1.0, 0.0, 1.0),
                                      (0.5, 0.7, 1.2)])
def test_frequency_and_presence_penalties_equal_the_reference(llm, qwen3_ckpt, prompts,
                                                              pp, fp, rp):
    got = _run(llm, prompts, _greedy(presence_penalty=pp, frequency_penalty=fp,
                                     repetition_penalty=rp))
    assert got == [_reference(qwen3_ckpt, p, pp, fp, rp) for p in prompts]


def test_penalized_and_plain_rows_share_a_batch(llm, qwen3_ckpt, prompts):
    """One request's penalties touch no other row of the step."""
    plain = _run(llm, prompts, _greedy())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [_greedy(), _greedy(frequency_penalty=2.0), _greedy()])
    assert [o.outputs[0].token_ids for o in outs] == [
        plain[0], _reference(qwen3_ckpt, prompts[1], 0.0, 2.0, 1.0), plain[2]]


def test_penalties_survive_preemption(qwen3_ckpt, prompts):
    """A preempted sequence is recomputed from prompt and output; its rank's history of it
    starts again and the output tokens still count as output."""
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", seed=0, block_size=4, num_kv_blocks=12,
              max_num_batched_tokens=16)
    got = _run(llm, prompts, _greedy(presence_penalty=0.9, frequency_penalty=0.6,
                                     repetition_penalty=1.4))
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == [_reference(qwen3_ckpt, p, 0.9, 0.6, 1.4) for p in prompts]


def test_a_penalized_request_reads_no_cached_prefix(qwen3_ckpt, prompts):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", seed=0, block_size=4)
    p = prompts[1]
    llm.generate({"prompt_token_ids": p}, _greedy())  # its blocks are now cached
    again = llm.generate({"prompt_token_ids": p}, _greedy())[0]
    assert again.num_cached_tokens > 0
    out = llm.generate({"prompt_token_ids": p}, _greedy(presence_penalty=1.5))[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == _reference(qwen3_ckpt, p, 1.5, 0.0, 1.0)


def test_speculative_decoding_drafts_nothing_for_a_penalized_row(qwen3_ckpt, prompts):
    spec = LLM(model=str(qwen3_ckpt), dtype="float32", seed=0, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
        "prompt_lookup_min": 1})
    got = _run(spec, prompts, _greedy(repetition_penalty=1.8))
    assert got == [_reference(qwen3_ckpt, p, 0.0, 0.0, 1.8) for p in prompts]


@pytest.mark.parametrize("field,value,says", [
    ("presence_penalty", 2.5, r"presence_penalty must be a finite number in \[-2, 2\]"),
    ("frequency_penalty", -3.0, r"frequency_penalty must be a finite number in \[-2, 2\]"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be a finite number > 0"),
    ("repetition_penalty", float("nan"), r"repetition_penalty must be a finite number > 0"),
])
def test_out_of_range_penalties_are_refused_naming_the_field(field, value, says):
    with pytest.raises(ValueError, match=says):
        SamplingParams(**{field: value})


def test_every_rank_refuses_a_penalized_sequence_without_its_whole_prompt():
    mirror = EpMirror(world_size=1, num_blocks=8, block_size=4, max_slots=4,
                      max_blocks_per_seq=4, vocab_size=64)
    cmd = StepCommand(step_id=0, new_seqs=(NewSeq(0, 1, 4, 6, -1,
                                                  RowSampling(presence_penalty=1.0)),))
    with pytest.raises(Exception, match="sampling penalties: its rank needs every prompt token"):
        mirror.validate(cmd)
