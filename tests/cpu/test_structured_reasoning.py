"""Structured output on a reasoning model (``reasoning_parser="qwen3"``) through the offline
``LLM``: the constraint holds once the reasoning ended, and is never silently dropped.

The model is the HTTP tests' scripted one (tests/http/scripted_model.py: its greedy next token
is a function of the last one). Three prompts, no chat template: one with no thinking tag whose
script is plain text (a completions prompt: the constraint holds from the first token), one
with no tag whose script opens ``<think>`` (the model reasons first, then the constraint holds),
one that ends inside an open ``<think>`` (the constraint waits for ``</think>``), one that
closed it (the constraint holds at once), and one whose ``</think>`` is an earlier turn's (the
new turn may reason first)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from epserve import LLM, SamplingParams
from epserve.head.structured_params import StructuredOutputsParams

_SCRIPTED = Path(__file__).resolve().parents[1] / "http" / "scripted_model.py"
CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def reasoning_llm(tmp_path_factory, demo_model_dir) -> LLM:
    spec = importlib.util.spec_from_file_location("scripted_model_for_so", _SCRIPTED)
    sm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sm)
    out = sm.make_scripted_checkpoint(
        tmp_path_factory.mktemp("so_reasoning"), demo_model_dir,
        {"[[plain]]": ["Use", "a", "toolbox"], "[[think]]": ["<think>", "Hmm.", "</think>", "Ok"]},
        ["Fine."], ["Sure."])
    return LLM(model=str(out), dtype="float32", max_model_len=64, reasoning_parser="qwen3")


def _run(llm: LLM, prompt: str, **so) -> tuple[list[str], str]:
    """(the output's tokens as text pieces, its text) of a greedy constrained completion."""
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=12,
                            structured_outputs=StructuredOutputsParams(**so))
    ids = tok.encode(prompt, add_special_tokens=False)
    c = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    return [tok.decode([t]) for t in c.token_ids], c.text


def _after_thinking(pieces: list[str]) -> str:
    assert "</think>" in pieces, pieces
    return "".join(pieces[pieces.index("</think>") + 1:]).replace("<|im_end|>", "")


def test_a_prompt_without_thinking_tags_is_constrained_from_the_first_token(reasoning_llm):
    pieces, text = _run(reasoning_llm, "[[plain]]", choice=CHOICES)
    assert text in CHOICES, (pieces, text)  # not the script's "Use a toolbox"
    pieces, text = _run(reasoning_llm, "[[plain]]", regex="[0-9]{3}")
    assert len(text) == 3 and text.isdigit(), (pieces, text)


def test_a_model_that_opens_its_reasoning_is_constrained_after_it(reasoning_llm):
    pieces, _ = _run(reasoning_llm, "[[think]]", choice=CHOICES)
    assert pieces[:3] == ["<think>", "Hmm.", "</think>"], pieces  # the reasoning, unconstrained
    assert _after_thinking(pieces) in CHOICES, pieces  # then the constraint (not "Ok")


def test_a_prompt_that_opened_the_reasoning_waits_for_its_end(reasoning_llm):
    # the prompt ends inside "<think>": its script goes on "Hmm.", "</think>", then the answer
    pieces, _ = _run(reasoning_llm, "[[plain]]<think>", choice=CHOICES)
    assert pieces[:2] == ["Hmm.", "</think>"], pieces
    assert _after_thinking(pieces) in CHOICES, pieces


def test_a_prompt_that_closed_the_reasoning_is_constrained_at_once(reasoning_llm):
    pieces, text = _run(reasoning_llm, "[[think]]<think>Hmm.</think>", choice=CHOICES)
    assert "<think>" not in pieces and text in CHOICES, (pieces, text)


def test_an_earlier_turns_closed_reasoning_leaves_the_new_turn_free_to_reason(reasoning_llm):
    # a tool loop's history: the last turn's "</think>" far back, then the new turn's trigger
    pieces, _ = _run(reasoning_llm, "<think>Hmm.</think>The weather is fine today. Go: [[think]]",
                     choice=CHOICES)
    assert pieces[:3] == ["<think>", "Hmm.", "</think>"], pieces  # it reasons first
    assert _after_thinking(pieces) in CHOICES, pieces
