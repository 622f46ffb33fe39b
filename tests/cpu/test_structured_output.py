"""Structured output below the HTTP edge: the constraint's validation, the token-mask rows of the
step command (codec, bounds, the mirror's verdicts), the mask applied to logits (against
xgrammar's own CPU kernel), and constrained generation through the offline LLM, with the
decode lookahead on, where every output must match (random weights: only the mask makes it)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
import xgrammar as xg

from epserve import LLM, SamplingParams, StructuredOutputsParams
from epserve.kernels.token_mask import apply_token_masks, mask_words, unpack_mask
from epserve.models.traits import EpCommandFailed, RowSampling
from epserve.worker import step_command as P
from epserve.worker.ep_mirror import EpMirror
from epserve.worker.step_command import (
    BlockUpdate, DecodeRow, MaskRow, NewSeq, PrefillRow, ProtocolError, StepCommand, WireLimits,
)

VOCAB = 70  # three words, the last one partly past the vocabulary
W = mask_words(VOCAB)


def _words(allowed) -> np.ndarray:
    w = np.zeros(W, np.uint32)
    for t in allowed:
        w[t >> 5] |= np.uint32(1 << (t & 31))
    return w.view(np.int32)


# --------------------------------------------------------------------------- the constraint

@pytest.mark.parametrize("fields, says", [
    ({"regex": "("}, "regex is an invalid regex"),
    ({"grammar": "root ::= "}, "grammar is an invalid grammar"),
    ({"grammar": 'root ::= undefined_rule'}, "grammar is an invalid grammar"),
    ({"json": {"type": 5}}, "json is an invalid JSON schema"),
    ({"json": "{not json"}, "json is not valid JSON"),
    ({"json": [1]}, "json must be a JSON schema"),
    ({"choice": []}, "choice must be a list"),
    ({"choice": ["a", ""]}, "choice must be a list"),
    ({"regex": "a", "choice": ["a"]}, "set exactly one"),
    ({}, "set exactly one"),
    ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern is not supported"),
    ({"regex": "a", "structural_tag": "{}"}, "structural_tag is not supported"),
    ({"json_object": True, "disable_additional_properties": True},
     "disable_additional_properties is not supported"),
    ({"regex": "a" * 70000}, "at most 65536"),
])
def test_invalid_constraints_name_the_field(fields, says):
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        StructuredOutputsParams(**fields)
    assert str(e.value).startswith("SamplingParams.structured_outputs")


def test_constraint_travels_as_a_dict():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = SamplingParams(structured_outputs={"json": schema})
    assert p.structured_outputs == StructuredOutputsParams(json=schema)
    assert p.structured_outputs.kind == "json"
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a", "frobnicate": 1})


def test_bounded_json_strings_hold_no_control_characters(demo_model_dir):
    from transformers import AutoTokenizer

    from epserve.head.grammar import GrammarBook

    book = GrammarBook(AutoTokenizer.from_pretrained(demo_model_dir), 2048, [2])
    for string in ({"type": "string", "maxLength": 8}, {"type": "string"}):
        p = StructuredOutputsParams(json={"type": "object", "properties": {"a": string},
                                          "required": ["a"]})
        m = book.matcher(book.compile(p)).matcher
        assert m.fork().accept_string('{"a": "ok"}')
        assert not m.fork().accept_string('{"a": "\x06')  # raw control characters: no JSON


# --------------------------------------------------------------------------- the mask kernel

def test_mask_applied_as_xgrammar_applies_it():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, VOCAB, generator=g)
    rows = np.array([4, 0, 2])
    words = np.stack([_words(range(0, VOCAB, 3)), _words([69]), _words([31, 32, 63, 64])])
    ours = apply_token_masks(logits.clone(), rows, words)
    ref = logits.clone()
    full = torch.full((5, W), -1, dtype=torch.int32)
    full[torch.from_numpy(rows)] = torch.from_numpy(words)
    xg.apply_token_bitmask_inplace(ref, full, vocab_size=VOCAB, backend="cpu")
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])  # unmasked rows untouched
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [69]
    assert unpack_mask(torch.from_numpy(words), VOCAB)[2].nonzero().flatten().tolist() == \
        [31, 32, 63, 64]


def test_mask_shape_is_checked():
    with pytest.raises(ValueError, match="words"):
        apply_token_masks(torch.zeros(2, VOCAB), np.array([0]), np.zeros((1, W + 1), np.int32))


# --------------------------------------------------------------------------- codec and bounds

def test_mask_rows_round_trip():
    words = [_words([0, 31, 69]), np.array([-1, -(2**31), 2**31 - 1], np.int32)]
    cmd = StepCommand(step_id=3, decode=(DecodeRow(0, 1, 5, 0), DecodeRow(1, 0, 6, 2)),
                      masks=(MaskRow(0, 1, words[0]), MaskRow(1, 0, words[1])))
    out = P.decode(P.encode(cmd), WireLimits(2, 4, 4, mask_words=W))
    assert out.masks == cmd.masks
    assert [m.words.tolist() for m in out.masks] == [w.tolist() for w in words]


def test_mask_bounds_are_protocol_errors():
    limits = WireLimits(1, 2, 4, mask_words=W)
    too_long = StepCommand(step_id=0, masks=(MaskRow(0, 0, np.zeros(W + 1, np.int32)),))
    with pytest.raises(ProtocolError, match="entry count"):
        P.decode(P.encode(too_long), limits)
    too_many = StepCommand(step_id=0, masks=tuple(MaskRow(0, s, _words([1])) for s in range(3)))
    with pytest.raises(ProtocolError, match="rows exceed"):
        P.decode(P.encode(too_many), limits)
    with pytest.raises(ProtocolError, match="int32"):
        P.encode(StepCommand(step_id=0, masks=(MaskRow(0, 0, np.zeros(W, np.float32)),)))


# --------------------------------------------------------------------------- the mirror

def _mirror() -> EpMirror:
    """Two ranks; (0, 0) and (1, 1) live with a block each, (1, 1) mid-prompt."""
    m = EpMirror(world_size=2, num_blocks=8, block_size=4, max_slots=4, max_blocks_per_seq=4,
                 vocab_size=VOCAB)
    setup = StepCommand(step_id=0, new_seqs=(NewSeq(0, 0, 0, 2, -1, RowSampling()),
                                             NewSeq(1, 1, 0, 5, -1, RowSampling())),
                        block_updates=(BlockUpdate(0, 0, 0, (1, 2)), BlockUpdate(1, 1, 0, (3, 4))),
                        prefill=(PrefillRow(0, 0, 0, (1, 2), True, 0, -1),
                                 PrefillRow(1, 1, 0, (1, 2), False, 0, 3)))
    m.validate(setup)
    m.apply(setup)
    return m


def _step(masks, prefill_sample: bool = True) -> StepCommand:
    return StepCommand(step_id=1, decode=(DecodeRow(0, 0, 5, 1),),
                       prefill=(PrefillRow(1, 1, 2, (3, 4, 5), prefill_sample, 0, -1),),
                       masks=tuple(masks))


def test_mirror_accepts_masks_of_sampled_rows():
    _mirror().validate(_step([MaskRow(0, 0, _words([3])), MaskRow(1, 1, _words([69]))]))
    _mirror().validate(P.decode(P.encode(_step([MaskRow(1, 1, _words([0]))]))))  # as decoded


@pytest.mark.parametrize("masks, prefill_sample, says, key", [
    ([MaskRow(0, 2, _words([3]))], True, "unknown sequence", (0, 2)),
    ([MaskRow(2, 0, _words([3]))], True, "rank 2 out of range", None),
    ([MaskRow(1, 1, _words([3]))], False, "samples no token", (1, 1)),
    ([MaskRow(0, 0, _words([3])), MaskRow(0, 0, _words([4]))], True, "two masks", (0, 0)),
    ([MaskRow(0, 0, np.zeros(W - 1, np.int32))], True, "2 words, the vocabulary needs 3",
     (0, 0)),
    ([MaskRow(0, 0, _words([]))], True, "no token of the vocabulary", (0, 0)),
    # bits past the vocabulary (ids 70..95) allow nothing
    ([MaskRow(0, 0, np.array([0, 0, -64], np.int32))], True, "no token of the vocabulary",
     (0, 0)),
])
def test_mirror_refuses_bad_masks(masks, prefill_sample, says, key):
    m = _mirror()
    with pytest.raises(EpCommandFailed) as e:
        m.validate(_step(masks, prefill_sample))
    assert says in e.value.reason
    assert e.value.bad_rows == (() if key is None else (key,))


# --------------------------------------------------------------------------- generation

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"]}


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    return LLM(model=str(demo_model_dir), dtype="float32", seed=0, decode_lookahead=True)


def _texts(llm, so, n=4, temperature=1.0, **kw):
    outs = llm.generate(["Answer:"] * 2, SamplingParams(
        n=n, temperature=temperature, seed=7, max_tokens=120, structured_outputs=so, **kw))
    cs = [c for o in outs for c in o.outputs]
    assert all(c.finish_reason == "stop" for c in cs), [(c.text, c.finish_reason) for c in cs]
    return [c.text for c in cs]


def test_generated_outputs_match(llm):
    launched = llm.model.lookahead.launched
    for text in _texts(llm, StructuredOutputsParams(json=SCHEMA)):
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in _texts(llm, StructuredOutputsParams(regex=r"[a-z]{2,5}-\d\d")):
        assert re.fullmatch(r"[a-z]{2,5}-\d\d", text)
    choices = ["red", "green", "blue"]
    assert set(_texts(llm, StructuredOutputsParams(choice=choices), temperature=0.0)) <= \
        set(choices)
    for text in _texts(llm, StructuredOutputsParams(grammar='root ::= "(" [0-9]{1,4} ")"')):
        assert re.fullmatch(r"\(\d{1,4}\)", text)
    assert llm.model.lookahead.launched > launched  # constrained steps queued ahead too


def test_choices_outside_the_basic_plane_come_out_whole(llm):
    """A choice literal keeps its characters (an emoji is one UTF-8 character, not two
    surrogate escapes the grammar would read as separate characters), quotes and
    backslashes included."""
    choices = ["\U0001F642 yes", "no \U0001F643", 'a "quoted" \\ one']
    texts = _texts(llm, StructuredOutputsParams(choice=choices), n=6)
    assert set(texts) <= set(choices) and len(set(texts)) > 1, texts


def test_unconstrained_output_is_unchanged_beside_constrained(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["Hello"], plain)[0].outputs[0].token_ids
    mixed = llm.generate(["Hello", "Answer:"], [plain, SamplingParams(
        temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(
            regex=r"\d+"))])
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch(r"\d+", mixed[1].outputs[0].text)


def test_grammar_that_cannot_continue_fails_only_its_request(llm):
    eos = llm.engine.cfg.eos_token_ids
    assert eos
    # "x" then the grammar is complete: only EOS may follow, and min_tokens bans EOS
    stuck = SamplingParams(max_tokens=8, min_tokens=4, temperature=0.0,
                           structured_outputs=StructuredOutputsParams(regex="x"))
    ok = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a, b = llm.generate(["Hi", "Hi"], [stuck, ok])
    assert a.outputs[0].finish_reason == "error"
    assert "allows no token" in a.error
    assert b.outputs[0].finish_reason == "length" and b.error is None


def test_invalid_constraint_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="regex is an invalid regex"):
        llm.generate(["Hi"], SamplingParams(structured_outputs={"regex": "[a-"}))
