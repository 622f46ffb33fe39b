"""The closed-thinking mask (the seed's ``RowMask``) on the offline ``LLM`` with
``reasoning_parser="qwen3"``: once a row has generated ``</think>``, neither thinking tag is
ever sampled again in that row, greedy and sampled, with speculative drafts too, and the same
when the prompt closed the block (``enable_thinking: false`` leaves ``<think>\n\n</think>``
there; a ``</think>`` of an earlier turn leaves the new turn free to think); without the
parser the same model reopens its thinking. The model
(tests/looping_ckpt.py) would think forever: after ``</think>`` its script goes back to
``<think>``. The seed's ``argmax_batch_masked`` (the trait's greedy pick under a ``RowMask``)
picks around its mask. Under EP: tests/ray/test_closed_thinking_ep.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from looping_ckpt import make_looping_checkpoint

from epserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def looping(tmp_path_factory, demo_model_dir) -> Path:
    return make_looping_checkpoint(tmp_path_factory.mktemp("looping"), demo_model_dir)


def _after_close(llm: LLM, params: SamplingParams) -> list[tuple[list[int], list[int]]]:
    """Per output: (its tokens up to and with the first ``</think>``, the tokens after it)."""
    tok = llm.get_tokenizer()
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    # the loop twice, then the trigger: n-gram drafts after "Hmm." are "</think><think>..."
    prompt = tok.encode("Hmm.</think><think>Hmm.</think><think>[[loop]]",
                        add_special_tokens=False)
    outs = []
    for c in llm.generate({"prompt_token_ids": prompt}, params)[0].outputs:
        ids = c.token_ids
        assert end in ids, tok.decode(ids)
        cut = ids.index(end) + 1
        outs.append((ids[:cut], ids[cut:]))
    return outs, (start, end)


def test_without_the_parser_the_model_thinks_again(looping):
    llm = LLM(model=str(looping), dtype="float32", max_model_len=64)
    outs, tags = _after_close(llm, SamplingParams(max_tokens=9, temperature=0))
    assert set(tags) <= set(outs[0][1])  # "<think>Hmm.</think><think>Hmm.</think>..."


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 2, "prompt_lookup_min": 1}])
def test_a_closed_thinking_block_never_reopens(looping, spec):
    llm = LLM(model=str(looping), dtype="float32", max_model_len=64, reasoning_parser="qwen3",
              speculative_config=spec)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, n=6, seed=3, ignore_eos=True)
    for params in (greedy, sampled):
        outs, tags = _after_close(llm, params)
        for before, after in outs:
            assert before[0] == tags[0] and after, (before, after)  # it thought, then went on
            assert not set(tags) & set(after), after


@pytest.mark.parametrize("parser", [None, "qwen3"])
def test_a_block_the_prompt_closed_never_reopens(looping, parser):
    llm = LLM(model=str(looping), dtype="float32", max_model_len=64, reasoning_parser=parser)
    tok = llm.get_tokenizer()
    tags = set(tok.convert_tokens_to_ids(["<think>", "</think>"]))
    prompt = tok.encode("Hi<think>\n\n</think>", add_special_tokens=False)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, n=4, seed=5, ignore_eos=True)
    outs = [c.token_ids for p in (greedy, sampled)
            for c in llm.generate({"prompt_token_ids": prompt}, p)[0].outputs]
    if parser is None:  # the model's script reopens at once
        assert outs[0][0] in tags, outs[0]
    else:
        assert all(len(o) == 6 and not tags & set(o) for o in outs), outs


def test_a_block_an_earlier_turn_closed_leaves_the_new_turn_free_to_think(looping):
    """A tool loop's history holds the last turn's ``</think>``: the new turn may think (and
    once it closed its own block, never again)."""
    llm = LLM(model=str(looping), dtype="float32", max_model_len=64, reasoning_parser="qwen3")
    tok = llm.get_tokenizer()
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    prompt = tok.encode("Hi<think>\n\n</think>\n\nThe weather is fine today. Go on: [[loop]]",
                        add_special_tokens=False)
    ids = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    assert ids[0] == start and end in ids, ids
    assert not {start, end} & set(ids[ids.index(end) + 1:]), ids


def test_argmax_batch_masked_picks_the_best_unmasked_token(looping):
    import torch

    from epserve.models.traits import ROW_MASK_NONE

    llm = LLM(model=str(looping), dtype="float32", max_model_len=64)
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [5.0, 4.0, 0.0, 0.0], [1.0, 0.0, 0.0, 2.0]])
    masks = [(1, ROW_MASK_NONE), (0, 1), (ROW_MASK_NONE, ROW_MASK_NONE)]
    model = llm.model
    assert model.argmax_batch(logits) == [1, 0, 3]
    assert model.argmax_batch_masked(logits, masks) == [2, 2, 3]


def test_a_tokenizer_without_the_tags_is_refused_naming_the_option(demo_model_dir):
    from epserve.cluster.engine_args import EngineArgs, check_reasoning_parser

    args = EngineArgs(model=str(demo_model_dir), reasoning_parser="qwen3")
    says = r"^reasoning_parser='qwen3': the model's tokenizer has no <think> and </think>"
    with pytest.raises(ValueError, match=says):
        check_reasoning_parser(args)  # what `epserve serve` checks before Ray starts
    with pytest.raises(ValueError, match=says):
        LLM(model=str(demo_model_dir), dtype="float32", reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="^reasoning_parser must be one of"):
        EngineArgs(reasoning_parser="granite")
