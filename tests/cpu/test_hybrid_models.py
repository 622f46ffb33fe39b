"""Gated-DeltaNet hybrid MoE models (Qwen3-Next, Qwen3.5-MoE, a Qwen3.5 saved as
ForConditionalGeneration) against transformers fp32 on tiny random checkpoints.

Every logit of every position must match within 1e-4: ragged prompts prefilled in one step
(each from its own state slot, garbage in every slot before), the same prompts split over
chunks that carry the conv and recurrent states, then decode steps of all sequences at once
(greedy picks fed back and checked against transformers'). A padded decode row pointed at the
spare slot changes nothing else; a step of no sequences runs; two EP ranks' expert shards give
the whole model; a broken DeltaNet tensor is named by the loader.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from epserve.kernels.attention import AttentionMetadata
from epserve.models.config import CheckpointError, ModelConfig
from epserve.models.layer_cache import KvCacheSpec, StateCacheSpec
from epserve.models.loader import load_model
from epserve.models.parallel import ParallelInfo
from fake_ep import LoopbackComm, RecordingComm
from paged_runner import BLOCK_SIZE, PagedRunner, Schedule, hf_logits, prompts
from tiny_ckpt import make_tiny_checkpoint

ATOL = 1e-4
LIN, FULL = "linear_attention", "full_attention"

CASES = {
    # grouped DeltaNet heads (2 key heads, 4 value heads), Dk 8 != Dv 12, GQA 4:2, rotary 4 of 16
    "qwen3_next": ("qwen3_next", {}),
    # attention at layers 1 and 3, a dense MLP at layer 1, MQA, rotary 4 of 8, conv width 3,
    # ungrouped DeltaNet heads, top-k weights not renormalised, tied embeddings
    "qwen3_next_dense_tied": ("qwen3_next", dict(
        layer_types=[LIN, FULL, LIN, FULL], mlp_only_layers=[1], num_key_value_heads=1,
        head_dim=8, partial_rotary_factor=0.5, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_conv_kernel_dim=3, shared_expert_intermediate_size=16, norm_topk_prob=False,
        tie_word_embeddings=True, seed=1)),
    # MHA with head_dim 32 (rotary 8), one key head for two value heads, Dk 16 > Dv 8
    "qwen3_5_moe": ("qwen3_5_moe", dict(
        num_key_value_heads=4, head_dim=32, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=8, shared_expert_intermediate_size=24,
        seed=2)),
    "qwen3_5_moe_vl_tied": ("qwen3_5_moe_vl", dict(tie_word_embeddings=True, seed=3)),
}


def _hf_model(path):
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def models(request, tmp_path_factory):
    arch, kwargs = CASES[request.param]
    path = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(request.param), **kwargs)
    ours, cfg = load_model(path, dtype=torch.float32, device="cpu")
    return _hf_model(path), ours, cfg


def test_the_layer_pattern_sets_each_layers_cache(models):
    _, ours, cfg = models
    specs = ours.layer_cache_specs()
    assert [isinstance(s, StateCacheSpec) for s in specs] == [t == LIN for t in cfg.layer_types]
    for spec in specs:
        if isinstance(spec, KvCacheSpec):
            assert spec == KvCacheSpec(cfg.num_kv_heads, cfg.head_dim)
        else:
            channels = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
                cfg.linear_num_value_heads * cfg.linear_value_head_dim
            assert spec.conv_shape == (channels, cfg.linear_conv_kernel_dim - 1)
            assert spec.recurrent_shape == (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                            cfg.linear_value_head_dim)
            assert (spec.conv_dtype, spec.recurrent_dtype) == (torch.float32, torch.float32)


def test_prefill_batch_matches_transformers(models):
    hf, ours, cfg = models
    batch = prompts(cfg.vocab_size, [5, 70, 9], seed=10)  # 70 crosses a 64-token chunk
    out = PagedRunner(ours, cfg).step([(f"s{i}", p) for i, p in enumerate(batch)], pad=3)
    for i, p in enumerate(batch):
        torch.testing.assert_close(out[f"s{i}"], hf_logits(hf, p), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_transformers(models):
    hf, ours, cfg = models
    a, b, c = prompts(cfg.vocab_size, [9, 30, 6], seed=11)
    sched = Schedule(PagedRunner(ours, cfg, seed=1), {"a": a, "b": b, "c": c})
    run, decode = sched.run, sched.decode
    run([("a", a[:4]), ("b", b[:17])])
    run([("a", a[4:]), ("b", b[17:])], pad=2)  # states carried from the first chunk
    run([decode("a"), decode("b"), ("c", c)])  # decodes and a whole prefill in one step
    for _ in range(3):
        run([decode("c"), decode("a"), decode("b")])  # every sequence decodes at once
    assert {k: len(v) for k, v in sched.tokens.items()} == {"a": 13, "b": 34, "c": 9}
    sched.check(hf, ATOL)  # and greedy agrees with transformers


def _states(runner):
    """The (conv_state, recurrent_state) pairs of the linear-attention layers."""
    return [pair for spec, pair in zip(runner.model.layer_cache_specs(), runner.caches)
            if isinstance(spec, StateCacheSpec)]


def test_a_padded_decode_row_at_the_spare_slot_touches_no_other_slot(models):
    hf, ours, cfg = models
    a, b = prompts(cfg.vocab_size, [7, 12], seed=12)
    runner = PagedRunner(ours, cfg, seed=2)
    first = runner.step([("a", a), ("b", b)])
    plain = copy.deepcopy(runner)
    rows = [("a", [int(first["a"][-1].argmax())]), ("b", [int(first["b"][-1].argmax())])]
    padded_out = runner.step(rows, pad_seqs=2)  # two padded sequences share the spare slot
    plain_out = plain.step(rows)
    for name in ("a", "b"):  # the same but for GEMM blocking over more rows
        torch.testing.assert_close(padded_out[name], plain_out[name], atol=1e-5, rtol=0)
    spare = runner.spare_slot
    assert _states(runner), "a hybrid has state caches"
    for (conv, rec), (conv0, rec0) in zip(_states(runner), _states(plain)):
        torch.testing.assert_close(conv[:spare], conv0[:spare], atol=1e-5, rtol=0)
        torch.testing.assert_close(rec[:spare], rec0[:spare], atol=1e-5, rtol=0)


def test_a_step_of_no_sequences_runs_without_state_slots(models):
    _, ours, cfg = models  # an idle EP rank runs the layers for the MoE collectives
    runner, empty = PagedRunner(ours, cfg), torch.empty(0, dtype=torch.int64)
    meta = AttentionMetadata(empty, (0,), (), torch.zeros((0, 1), dtype=torch.int32), BLOCK_SIZE)
    with torch.no_grad():
        assert ours(empty, empty, runner.caches, meta).shape == (0, cfg.hidden_size)


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def next_ckpt(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("next_ckpt"))


def test_two_expert_shards_reproduce_the_whole_model(next_ckpt):
    """Routed experts sharded over two EP ranks (the shared expert on each rank's own rows)."""
    def logits(parallel):
        model, cfg = load_model(next_ckpt, dtype=torch.float32, device="cpu", parallel=parallel)
        return model, PagedRunner(model, cfg).step([("a", [5, 9, 300, 17, 4]), ("b", [8, 8])])

    _, full = logits(ParallelInfo())
    recorder = RecordingComm()
    rank1, _ = logits(ParallelInfo(rank=1, world_size=2, ep_comm=recorder))
    assert rank1.layers[0].ffn.routed.experts.w13.shape[0] == 4  # 4 of 8 experts
    _, rank0 = logits(ParallelInfo(rank=0, world_size=2, ep_comm=LoopbackComm(recorder.local_fns)))
    assert len(recorder.local_fns) == 4  # every layer's MoE went through the comm
    for name in full:
        torch.testing.assert_close(rank0[name], full[name], atol=1e-5, rtol=0)


def _copy_with(src, dst, edit) -> None:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_a_missing_or_misshapen_deltanet_tensor_is_named(next_ckpt, tmp_path):
    name = "model.layers.1.linear_attn.A_log"
    _copy_with(next_ckpt, tmp_path / "missing", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing 1 tensor.*{name}"):
        load_model(tmp_path / "missing", dtype=torch.float32, device="cpu")
    conv = "model.layers.2.linear_attn.conv1d.weight"
    _copy_with(next_ckpt, tmp_path / "shape", lambda t: t.update({conv: t[conv][:, :, :3].contiguous()}))
    with pytest.raises(CheckpointError, match=f"{conv}.*has shape"):
        load_model(tmp_path / "shape", dtype=torch.float32, device="cpu")


def test_an_mtp_head_in_the_checkpoint_loads_with_a_log_line(next_ckpt, tmp_path, caplog):
    """The checkpoints ship ``mtp.*`` weights (the MTP draft head): the target leaves them to
    ``models.mtp`` (loaded only for method 'mtp'), says so once, and loads as without them."""
    extra = {"mtp.fc.weight": torch.ones(4, 4), "mtp.layers.0.input_layernorm.weight":
             torch.ones(4)}
    _copy_with(next_ckpt, tmp_path / "mtp", lambda t: t.update(extra))
    with caplog.at_level(logging.INFO, logger="epserve.models.qwen3_next"):
        load_model(tmp_path / "mtp", dtype=torch.float32, device="cpu")
    assert [r.message for r in caplog.records if "MTP" in r.message] == [
        "MTP head weights, for speculative_config method 'mtp' only: 2 tensors under mtp."]


def test_a_multimodal_checkpoint_serves_its_language_model(tmp_path, caplog):
    path = make_tiny_checkpoint("qwen3_5_moe_vl", tmp_path / "vl", seed=4)
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.architecture, cfg.num_layers, cfg.rotary_dim) == \
        ("Qwen3_5MoeForConditionalGeneration", 4, 4)
    with caplog.at_level(logging.INFO, logger="epserve.models.qwen3_next"):
        load_model(path, dtype=torch.float32, device="cpu")
    assert [r.message for r in caplog.records if "vision" in r.message] == [
        "vision weights ignored until vision exists: 21 tensors under model.visual."]


def test_older_configs_give_the_same_layer_pattern_and_rotary(next_ckpt):
    d = json.loads((next_ckpt / "config.json").read_text())
    want = ModelConfig.from_hf_dict(d)
    older = dict(d, full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=10000.0)
    for key in ("layer_types", "rope_parameters"):
        older.pop(key)
    assert ModelConfig.from_hf_dict(older) == want
    with pytest.raises(CheckpointError, match="layer_types"):
        ModelConfig.from_hf_dict(dict(d, layer_types=[LIN, "mamba", LIN, FULL]))


def test_attention_only_models_describe_kv_caches_only(qwen3_ckpt):
    ours, cfg = load_model(qwen3_ckpt, dtype=torch.float32, device="cpu")
    assert ours.layer_cache_specs() == (KvCacheSpec(cfg.num_kv_heads, cfg.head_dim),) * cfg.num_layers
