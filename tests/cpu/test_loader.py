"""The checkpoint loader: clear errors for broken folders, dummy weights, expert sharding."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from epserve.kernels.attention import AttentionMetadata
from epserve.models.config import CheckpointError, ModelConfig
from epserve.models.layers import SparseMoeBlock
from epserve.models.loader import load_model
from epserve.models.parallel import ParallelInfo
from fake_ep import LoopbackComm, RecordingComm
from tiny_ckpt import make_tiny_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def base_ckpts(qwen3_ckpt, mixtral_ckpt, tmp_path_factory):
    """The session's tiny checkpoints (tests/conftest.py) plus a sharded one; never modified."""
    sharded = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("sharded"), sharded=True)
    return {"qwen3_moe": qwen3_ckpt, "mixtral": mixtral_ckpt, "sharded": sharded}


@pytest.fixture
def ckpt(base_ckpts, tmp_path):
    """A private copy of a base checkpoint that a test may break."""
    def copy(name: str = "qwen3_moe"):
        return shutil.copytree(base_ckpts[name], tmp_path / name)
    return copy


def _load(path, **kw):
    return load_model(path, dtype=torch.float32, device=CPU, **kw)


def _rewrite(path, edit):
    """Apply ``edit`` to the tensors of ``path/model.safetensors`` and write them back."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path, edit):
    cfg_file = path / "config.json"
    d = json.loads(cfg_file.read_text())
    edit(d)
    cfg_file.write_text(json.dumps(d))


def _logits(model, cfg, tokens):
    n = len(tokens)
    shape = (-(-n // 4), 4, cfg.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    table = torch.arange(shape[0], dtype=torch.int32)[None]
    meta = AttentionMetadata(torch.arange(n), (0, n), (n,), table, 4)
    return model.compute_logits(model(torch.tensor(tokens), torch.arange(n), kv, meta))


# --------------------------------------------------------------------------- broken folders


def test_missing_tensors_are_all_named(ckpt):
    path = ckpt()
    gone = ["model.layers.1.mlp.experts.3.up_proj.weight", "model.norm.weight"]
    _rewrite(path, lambda t: [t.pop(n) for n in gone])
    with pytest.raises(CheckpointError, match="missing 2 tensor") as err:
        _load(path)
    assert all(n in str(err.value) for n in gone)


def test_wrong_shape_names_tensor_and_both_shapes(ckpt):
    path = ckpt()
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(path, lambda t: t.__setitem__(name, torch.zeros(16, 64)))
    with pytest.raises(CheckpointError) as err:
        _load(path)
    assert name in str(err.value) and "(16, 64)" in str(err.value) and "(32, 64)" in str(err.value)


def test_tensors_for_an_extra_layer_are_rejected(ckpt):
    path = ckpt()
    _rewrite(path, lambda t: t.__setitem__("model.layers.2.input_layernorm.weight", torch.ones(64)))
    with pytest.raises(CheckpointError, match="layer 2 does not exist.*num_layers=2"):
        _load(path)


def test_unsupported_architecture_is_named(ckpt):
    path = ckpt()
    _edit_config(path, lambda d: d.__setitem__("architectures", ["LlamaForCausalLM"]))
    with pytest.raises(CheckpointError) as err:
        _load(path)
    msg = str(err.value)
    assert "LlamaForCausalLM" in msg and "Qwen3MoeForCausalLM" in msg and "MixtralForCausalLM" in msg


def test_unsupported_rope_type_is_named(ckpt):
    path = ckpt()
    _edit_config(path, lambda d: d.__setitem__("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4,
                                                                   "factor": 4.0}))
    with pytest.raises(CheckpointError, match="rope_type='yarn'"):
        _load(path)


def test_missing_config_json_names_the_path(ckpt):
    path = ckpt()
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json") as err:
        _load(path)
    assert str(path) in str(err.value)


def test_folder_without_weights_names_the_path(ckpt):
    path = ckpt()
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no safetensors weights") as err:
        _load(path)
    assert str(path) in str(err.value)


def test_sharded_index_with_a_missing_shard(ckpt):
    path = ckpt("sharded")
    assert (path / "model.safetensors.index.json").is_file()
    shard = sorted(path.glob("model-*.safetensors"))[2]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        _load(path)


def test_unknown_config_override_is_rejected(ckpt):
    with pytest.raises(ValueError, match="num_hidden_layers"):
        _load(ckpt(), config_overrides={"num_hidden_layers": 1})


# --------------------------------------------------------------------------- configs and formats


def test_transformers_4_config_layout_parses_the_same(base_ckpts):
    d5 = json.loads((base_ckpts["qwen3_moe"] / "config.json").read_text())
    d4 = {k: v for k, v in d5.items() if k not in ("rope_parameters", "num_local_experts", "dtype")}
    d4.update(rope_theta=d5["rope_parameters"]["rope_theta"], num_experts=8, torch_dtype="float32",
              use_sliding_window=False, sliding_window=4096)
    assert ModelConfig.from_hf_dict(d4) == ModelConfig.from_hf_dict(d5)
    assert ModelConfig.from_hf_dict(d5).num_experts == 8


def test_fused_transformers_5_names_load_like_per_expert_names(base_ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    for arch in ("qwen3_moe", "mixtral"):
        src = base_ckpts[arch]
        hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        fused = tmp_path / arch
        shutil.copytree(src, fused)
        (fused / "model.safetensors").unlink()
        state = {k: v.contiguous().clone() for k, v in hf.state_dict().items()}
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
        save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
        a, _ = _load(src)
        b, _ = _load(fused)
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(p, q), name


def test_dummy_format_builds_a_working_model_from_config_only(base_ckpts, tmp_path):
    (tmp_path / "config.json").write_text((base_ckpts["mixtral"] / "config.json").read_text())
    torch.manual_seed(0)
    model, cfg = _load(tmp_path, load_format="dummy", config_overrides={"num_layers": 3})
    assert cfg.num_layers == 3 and len(model.layers) == 3 and not model.training
    assert torch.equal(model.norm.weight, torch.ones(cfg.hidden_size))
    assert 0.015 < float(model.layers[2].ffn.experts.w13.std()) < 0.025
    assert not any(p.requires_grad for p in model.parameters())
    logits = _logits(model, cfg, [5, 6, 7, 8, 9])
    assert logits.shape == (5, cfg.vocab_size) and torch.isfinite(logits).all()
    torch.manual_seed(0)
    again, _ = _load(tmp_path, load_format="dummy", config_overrides={"num_layers": 3})
    assert torch.equal(again.layers[1].self_attn.qkv_proj.weight, model.layers[1].self_attn.qkv_proj.weight)


# --------------------------------------------------------------------------- expert parallelism


def test_rank_loads_only_its_expert_shard(base_ckpts):
    path = base_ckpts["qwen3_moe"]
    tensors = load_file(path / "model.safetensors")
    model, cfg = _load(path, parallel=ParallelInfo(rank=1, world_size=2))
    experts = model.layers[1].ffn.experts
    assert (experts.expert_start, experts.expert_end) == (4, 8)
    assert experts.w13.shape == (4, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    for j, e in enumerate(range(4, 8)):
        p = f"model.layers.1.mlp.experts.{e}"
        gate_up = torch.cat([tensors[f"{p}.gate_proj.weight"], tensors[f"{p}.up_proj.weight"]])
        assert torch.equal(experts.w13[j], gate_up)
        assert torch.equal(experts.w2[j], tensors[f"{p}.down_proj.weight"])


def test_experts_not_divisible_by_world_size(base_ckpts):
    with pytest.raises(ValueError, match="num_experts=8.*world_size=3"):
        _load(base_ckpts["qwen3_moe"], parallel=ParallelInfo(rank=0, world_size=3))


def test_world_size_above_one_needs_an_ep_comm(base_ckpts):
    model, cfg = _load(base_ckpts["qwen3_moe"], parallel=ParallelInfo(rank=0, world_size=2))
    with pytest.raises(RuntimeError, match="ep_comm"):
        _logits(model, cfg, [3, 4, 5])


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_two_expert_shards_reproduce_the_whole_model(base_ckpts, load_format):
    path, tokens = base_ckpts["mixtral"], [7, 100, 31, 250, 9, 12]

    def build(parallel):
        torch.manual_seed(5)
        return _load(path, parallel=parallel, load_format=load_format)

    full, cfg = build(ParallelInfo())
    recorder = RecordingComm()
    rank1, _ = build(ParallelInfo(rank=1, world_size=2, ep_comm=recorder))
    _logits(rank1, cfg, tokens)
    loopback = LoopbackComm(recorder.local_fns)
    rank0, _ = build(ParallelInfo(rank=0, world_size=2, ep_comm=loopback))
    n_moe = sum(isinstance(m, SparseMoeBlock) for m in rank0.modules())
    assert len(recorder.local_fns) == n_moe == cfg.num_layers
    torch.testing.assert_close(_logits(rank0, cfg, tokens), _logits(full, cfg, tokens), atol=1e-5, rtol=0)
