"""The closed-thinking mask (the seed's ``RowMask``) on the offline ``LLM`` with
``reasoning_parser="qwen3"``: once a row has generated ``</think>``, neither thinking tag is
ever sampled again in that row, greedy and sampled, with speculative drafts too; without the
parser the same model reopens its thinking. The model is the HTTP tests' scripted one
(tests/http/scripted_model.py: its next token is a function of the last one) with one change:
after ``</think>`` its script goes back to ``<think>``, so it would think forever."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from epserve import LLM, SamplingParams

_SCRIPTED = Path(__file__).resolve().parents[1] / "http" / "scripted_model.py"
LOOP = ["<think>", "Hmm.", "</think>"]


def _scripted_module():
    spec = importlib.util.spec_from_file_location("scripted_model_for_cpu", _SCRIPTED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def looping(tmp_path_factory, demo_model_dir) -> Path:
    """The scripted checkpoint whose ``</think>`` is followed by ``<think>`` (not the end)."""
    sm = _scripted_module()
    out = sm.make_scripted_checkpoint(tmp_path_factory.mktemp("looping"), demo_model_dir,
                                      {"[[loop]]": LOOP}, ["Ok."], ["Ok!"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    start, end, eos = tok.convert_tokens_to_ids(["<think>", "</think>", sm.IM_END])
    path = next(out.glob("*.safetensors"))
    weights = load_file(str(path))
    emb, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    col = int(emb[end].argmax())  # "</think>"'s one-hot column
    head[eos, col], head[start, col] = 0.0, 10.0
    save_file(weights, str(path), metadata={"format": "pt"})
    return out


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
