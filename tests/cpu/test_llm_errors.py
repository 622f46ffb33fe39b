"""What a user of the offline API sees when something is wrong: a ``ValueError`` (or
``CheckpointError``, ``CapabilityAbsent``) that names the culprit, raised before anything
runs, and an engine left as if the call never happened; failures inside a run end only the
requests concerned, with finish_reason "error" (aborts: ``test_llm_abort.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from epserve import LLM, SamplingParams
from epserve.models.config import CheckpointError
from epserve.models.traits import CapabilityAbsent
from llm_kit import _greedy, _ids, _idle, _within


# ---------------------------------------------------------------------------- SamplingParams

ONE_BAD_VALUE_PER_FIELD = {
    "n": 0, "temperature": -1.0, "top_p": 0.0, "top_k": -2, "min_p": 1.5, "seed": 1.5,
    "max_tokens": 0, "min_tokens": -1, "stop": [""], "stop_token_ids": [-1], "ignore_eos": 1,
    "logprobs": -1, "prompt_logprobs": -1, "skip_special_tokens": None,
    "include_stop_str_in_output": "yes",
}


@pytest.mark.parametrize("field", sorted(ONE_BAD_VALUE_PER_FIELD))
def test_invalid_sampling_param_names_the_field(field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: ONE_BAD_VALUE_PER_FIELD[field]})


def test_sampling_params_of_the_wrong_kind_are_refused_by_generate(llm):
    ok = [_ids([5, 6, 7]), _ids([8, 9])]
    with pytest.raises(ValueError, match=r"sampling_params\[1\].*SamplingParams.*dict"):
        llm.generate(ok, [_greedy(max_tokens=2), {"temperature": 0}])
    _idle(llm)
    with pytest.raises(ValueError, match=r"sampling_params: 1 given for 2 prompts"):
        llm.generate(ok, [_greedy(max_tokens=2)])
    _idle(llm)
    with pytest.raises(ValueError, match=r"sampling_params must be"):
        llm.generate(ok, {"temperature": 0, "max_tokens": 2})  # a dict of 2 keys, 2 prompts
    _idle(llm)


# ---------------------------------------------------------------------------- prompts


def test_prompt_longer_than_max_model_len_refused_naming_it(llm):
    batch = [_ids([5, 6, 7]), _ids(list(range(3, 3 + 64))), _ids([8, 9])]
    with pytest.raises(ValueError, match=r"prompts\[1\].*64 tokens.*max_model_len=64"):
        llm.generate(batch, _greedy(max_tokens=4))
    _idle(llm)
    with pytest.raises(ValueError, match=r"prompts\[0\].*max_model_len=64"):
        llm.stream(_ids(list(range(3, 3 + 80))), _greedy(max_tokens=4))
    _idle(llm)


def test_refused_generate_leaves_no_trace(qwen3_ckpt):
    """A refused call must not shift the engine's seed stream: the next unseeded request
    samples what it would have sampled on a fresh LLM with the same seed."""
    sp = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    fresh = LLM(model=str(qwen3_ckpt), dtype="float32", seed=0)
    want = fresh.generate(_ids([5, 6, 7]), sp)[0].outputs[0].token_ids
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", seed=0)
    with pytest.raises(ValueError, match=r"prompts\[2\]"):
        llm.generate([_ids([5, 6, 7]), _ids([9, 10]), _ids([5, 999])], sp)
    assert llm.engine.stats.prompt_tokens == 0
    assert llm.generate(_ids([5, 6, 7]), sp)[0].outputs[0].token_ids == want


def test_too_long_request_added_while_others_run(qwen3_ckpt):
    prompts = [[5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17], [20, 21]]
    params = [_greedy(max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12, ignore_eos=True),
              _greedy(max_tokens=12, ignore_eos=True)]
    ref = LLM(model=str(qwen3_ckpt), dtype="float32", max_model_len=64)
    want = [o.outputs[0].token_ids for o in ref.generate([_ids(p) for p in prompts], params)]

    llm = LLM(model=str(qwen3_ckpt), dtype="float32", max_model_len=64)
    eng = llm.engine
    finished = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    for _ in range(3):
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert eng.has_unfinished()
    with pytest.raises(ValueError, match=r"max_model_len=64"):
        eng.add_request("bad", list(range(3, 3 + 70)), _greedy(max_tokens=4))
    with pytest.raises(ValueError, match=r"already in use"):
        eng.add_request("r0", [5, 6], _greedy(max_tokens=4))
    assert "bad" not in eng.requests
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["r0", "r1", "r2"]
    assert [finished[f"r{i}"].outputs[0].token_ids for i in range(3)] == want
    _idle(llm)


@pytest.mark.parametrize("ids, what", [
    ([5, 320], r"320 is not a token id in \[0, 320\)"),
    ([5, -1], r"-1 is not a token id"),
    ([5, True], r"True is not a token id"),
    ([5, 6.0], r"6\.0 is not a token id"),
    ([], r"prompt is empty"),
])
def test_bad_token_ids_refused(llm, ids, what):
    with pytest.raises(ValueError, match=rf"prompts\[1\].*{what}"):
        llm.generate([_ids([5, 6]), _ids(ids)], _greedy(max_tokens=2))
    _idle(llm)


@pytest.mark.parametrize("prompt", [7, None, {"tokens": [1, 2]}, {"prompt_token_ids": "5 6"}])
def test_prompt_of_the_wrong_shape_refused(llm, prompt):
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        llm.generate([prompt], _greedy(max_tokens=2))
    _idle(llm)


def test_text_prompt_without_tokenizer_says_what_to_do(llm):
    for prompt in ("Hello", {"prompt": "Hello"}):
        with pytest.raises(ValueError, match=r"prompts\[0\].*no tokenizer.*prompt_token_ids") as e:
            llm.generate(prompt, _greedy(max_tokens=2))
        assert str(llm.model_path) in str(e.value)
    with pytest.raises(ValueError, match=r"no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    _idle(llm)


# ---------------------------------------------------------------------------- checkpoints


@pytest.fixture
def ckpt_copy(qwen3_ckpt, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(qwen3_ckpt, dst)
    return dst


def _rewrite_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_missing_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(CheckpointError, match=rf"{missing}.*no such folder"):
        LLM(model=str(missing))


def test_missing_config(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"no config.json at {ckpt_copy}/config.json"):
        LLM(model=str(ckpt_copy))


def test_unreadable_config(ckpt_copy):
    (ckpt_copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"cannot read {ckpt_copy}/config.json"):
        LLM(model=str(ckpt_copy))


def test_unsupported_architecture(ckpt_copy):
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"'LlamaForCausalLM' is not supported.*Qwen3MoeForCausalLM"):
        LLM(model=str(ckpt_copy))


def test_no_weights(ckpt_copy):
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=rf"no safetensors weights in {ckpt_copy}"):
        LLM(model=str(ckpt_copy))
    LLM(model=str(ckpt_copy), load_format="dummy")  # random weights need no files


def test_unreadable_weights(ckpt_copy):
    """A weights file cut short (an interrupted download) names the file."""
    f = ckpt_copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{f}: not a readable safetensors file \("):
        LLM(model=str(ckpt_copy))


def test_tensor_removed(ckpt_copy):
    name = "model.layers.1.self_attn.q_proj.weight"
    _rewrite_weights(ckpt_copy, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing 1 tensor\(s\): {name}"):
        LLM(model=str(ckpt_copy))


def test_tensor_with_wrong_shape(ckpt_copy):
    from safetensors.torch import load_file

    names = [n for n in load_file(str(ckpt_copy / "model.safetensors")) if "up_proj" in n]
    name = names[0]

    def shrink(t):
        t[name] = t[name][:-1].contiguous()

    _rewrite_weights(ckpt_copy, shrink)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape"):
        LLM(model=str(ckpt_copy))


# ---------------------------------------------------------------------------- options


@pytest.mark.parametrize("kwargs, what", [
    (dict(ep_size=3), r"num_experts=\d+ is not divisible by world_size=3"),
    (dict(ep_size=0), r"ep_size must be a positive integer"),
    (dict(device="foo"), r"device='foo'"),
    (dict(block_size=0), r"block_size must be a positive integer"),
    (dict(num_kv_blocks=0), r"num_kv_blocks must be a positive integer"),
    (dict(max_num_seqs=0), r"max_num_seqs must be a positive integer"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens must be a positive integer"),
    (dict(max_model_len=0), r"max_model_len must be a positive integer"),
    (dict(max_model_len=5000), r"max_model_len=5000 exceeds.*1024"),
    (dict(long_prefill_token_threshold=-1), r"long_prefill_token_threshold"),
    (dict(dtype="int8"), r"dtype must be one of"),
    (dict(load_format="pt"), r"load_format='pt'"),
    (dict(tokenizer="/nonexistent-tokenizer"), r"tokenizer='/nonexistent-tokenizer'"),
])
def test_bad_llm_option_names_it(qwen3_ckpt, kwargs, what):
    with pytest.raises(ValueError, match=what):
        LLM(model=str(qwen3_ckpt), **kwargs)


def test_cuda_device_without_cuda_is_a_clear_error(qwen3_ckpt):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"device='cuda'.*CUDA is not available"):
        LLM(model=str(qwen3_ckpt), device="cuda")


# ---------------------------------------------------------------------------- capabilities


def test_beam_search_and_lora_are_absent_capabilities(llm):
    with pytest.raises(CapabilityAbsent, match=r"beam_search needs the 'beam' capability") as e:
        llm.beam_search([_ids([5, 6, 7])], SamplingParams(max_tokens=4))
    assert isinstance(e.value, NotImplementedError)
    with pytest.raises(CapabilityAbsent, match=r"lora_request.*'adapters' capability"):
        llm.generate(_ids([5, 6, 7]), _greedy(max_tokens=4), lora_request={"name": "a", "id": 1})
    with pytest.raises(CapabilityAbsent, match=r"'adapters'"):
        llm.chat([{"role": "user", "content": "x"}], lora_request=object())
    _idle(llm)
    # lora_request=None is the plain path.
    assert llm.generate(_ids([5, 6, 7]), _greedy(max_tokens=2), lora_request=None)[0].finished


# ---------------------------------------------------------------------------- KV cache


def test_kv_pool_too_small_for_one_sequence_fails_it_with_error(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", num_kv_blocks=2, block_size=4)
    big, fits = list(range(3, 23)), [5, 6, 7]
    outs = _within(30, llm.generate, [_ids(big), _ids(fits)],
                   [_greedy(max_tokens=4), _greedy(max_tokens=3, ignore_eos=True)])
    bad, ok = outs
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "KV cache" in bad.error and "20 tokens" in bad.error
    assert bad.outputs[0].token_ids == []
    # The other request is unaffected: same tokens as on a pool of the default size.
    ref = LLM(model=str(qwen3_ckpt), dtype="float32")
    assert ok.outputs[0].finish_reason == "length"
    assert ok.outputs[0].token_ids == ref.generate(
        _ids(fits), _greedy(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids
    # A prompt that fits but outgrows the whole pool while decoding fails the same way.
    grow = _within(30, llm.generate, _ids([5, 6, 7, 8, 9]), _greedy(max_tokens=10, ignore_eos=True))[0]
    assert grow.outputs[0].finish_reason == "error" and "KV cache" in grow.error
    assert 0 < len(grow.outputs[0].token_ids) < 10
    _idle(llm)
