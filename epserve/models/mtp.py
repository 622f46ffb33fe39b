"""The multi-token-prediction (MTP) head of the gated-DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE):
the checkpoint's ``mtp.*`` tensors as a one-step draft model beside the target.

Shapes: T rows in the flat batch, H hidden, V vocab.

The published architecture (the checkpoints' tensors, as vLLM's ``qwen3_next_mtp`` /
``qwen3_5_mtp`` and SGLang's ``qwen3_next_mtp`` run them):
- a row of the head pairs the target's hidden state at position p (its output after its final
  norm, the one its LM head reads) with the token at p + 1 (the target's next token), and runs
  at position p: rope rotates by p and its K/V goes into the head's own paged cache at the
  slot of position p, so the head's KV lines up with the target's block tables;
- input fusion: ``fc(cat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)))``,
  the embedding first, ``fc`` 2H -> H without bias; ``embed_tokens`` and ``lm_head`` are the
  target's (the checkpoint has no copies of its own);
- ``mtp.layers.{i}``: a decoder block like the target's full-attention blocks (zero-centred
  pre-norms, gated attention with q/k norms and partial rotary, MoE with the gated shared
  expert; dense only where the target's own rule makes layer ``i`` dense), then the
  zero-centred final norm ``mtp.norm``; the logits are the target's ``lm_head`` of that;
- its output at row p drafts the token at p + 2. A second draft runs the head again at
  position p + 1 on its own output hidden (after ``mtp.norm``) and the first draft token, and
  so on (vLLM's chaining for k > 1). With several ``mtp.layers`` (none shipped so far), draft
  step s runs layer ``s % num_layers`` (vLLM's rule); each layer has its own paged KV.

The config gives the layer count as ``num_nextn_predict_layers`` (Qwen3-Next, often absent)
or ``mtp_num_hidden_layers`` (Qwen3.5, in ``text_config`` for a multimodal checkpoint); when
absent it is the number of ``mtp.layers.{i}`` in the checkpoint. The ``mtp.*`` names sit at the
top level in every layout (also in a ``...ForConditionalGeneration`` checkpoint).

Invariants: expert parallelism enters only through ``ParallelInfo``, as in the target (the
routed experts sharded over EP ranks, the shared expert on every rank for its own rows). The
head never owns the target's modules: ``parameters()`` are its own weights only.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from epserve.kernels.attention import AttentionMetadata
from epserve.kernels.linear import linear
from epserve.models.config import CheckpointError, ModelConfig
from epserve.models.gated_attention import map_gated_attention
from epserve.models.layer_cache import KvCacheSpec
from epserve.models.layers import (DenseMLP, RotaryEmbedding, WeightMap, ZeroCentredRMSNorm,
                                   map_dense_mlp, map_experts, moe_or_dense)
from epserve.models.loader import (INDEX_FILE, default_dtype, init_dummy_weights,
                                   safetensors_files)
from epserve.models.parallel import ParallelInfo
from epserve.models.qwen3_next import HybridDecoderLayer, SharedExpertMoeBlock

PREFIX = "mtp."
#: config.json fields that give the number of MTP layers (Qwen3-Next, Qwen3.5)
LAYER_COUNT_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")


class MtpHead(nn.Module):
    """The MTP head over the target's ``embed_tokens`` and ``lm_head`` (shared, not owned).

    ``forward`` runs one draft step over the same paged-KV ``AttentionMetadata`` a target
    step uses (its rows, positions and block tables), with the head's own KV cache
    (``cache_spec``); ``compute_logits`` is the target's LM head of its output.
    """

    def __init__(self, cfg: ModelConfig, embed_tokens: nn.Embedding, lm_head: nn.Module,
                 num_layers: int = 1, parallel: ParallelInfo = ParallelInfo()):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"MtpHead: num_layers={num_layers} must be >= 1")
        self.cfg, self.parallel = cfg, parallel
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        # shared with the target: a plain tuple, so that they are not submodules of the head
        self._target_modules = (embed_tokens, lm_head)
        self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        # every MTP block is full attention, whatever the target's layer pattern says
        full = dataclasses.replace(cfg, layer_types=())
        self.layers = nn.ModuleList(
            HybridDecoderLayer(full, i, moe_or_dense(cfg, parallel, i, SharedExpertMoeBlock))
            for i in range(num_layers))
        self.norm = ZeroCentredRMSNorm(h, eps)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target_modules[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._target_modules[1]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer_for_step(self, step: int) -> int:
        """The index of the layer that draft step ``step`` (0 for the first draft) runs."""
        return step % len(self.layers)

    def cache_spec(self) -> KvCacheSpec:
        """The paged KV of one MTP layer (every layer's is the same)."""
        return self.layers[0].cache_spec()

    def layer_cache_specs(self) -> tuple[KvCacheSpec, ...]:
        """One paged KV per MTP layer, in layer order."""
        return tuple(layer.cache_spec() for layer in self.layers)

    def forward(self, input_ids: torch.Tensor, target_hidden: torch.Tensor,
                positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, rope: RotaryEmbedding, step: int = 0) -> torch.Tensor:
        """One draft step.

        input_ids: [T] int64, the token at p + 1 of each row; target_hidden: [T, H], the
        target's hidden at p after its final norm (or, for a chained draft, this head's
        previous output); positions: [T] int64, p; kv_cache: ``(k_cache, v_cache)`` [NB, BS,
        Hkv, D] of layer ``layer_for_step(step)``, into which this step's K/V is written at
        ``meta.slot_mapping`` (``meta`` as for the target: ``seq_lens`` count the head's KV
        positions, this step's included); rope: the target's rotary cache.

        Returns hidden [T, H] after ``mtp.norm``: ``compute_logits`` of it drafts the token at
        p + 2, and it is the ``target_hidden`` of the next chained draft.
        """
        if target_hidden.shape != (input_ids.shape[0], self.cfg.hidden_size):
            raise ValueError(f"MtpHead: target_hidden shape {tuple(target_hidden.shape)} does "
                             f"not match {input_ids.shape[0]} rows of hidden size "
                             f"{self.cfg.hidden_size}")
        embeds = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))  # [T, H]
        hidden = self.pre_fc_norm_hidden(target_hidden.to(embeds.dtype))  # [T, H]
        fused = linear(torch.cat([embeds, hidden], dim=-1), self.fc.weight)  # [T, H]
        layer = self.layers[self.layer_for_step(step)]
        out, residual = layer(positions, fused, None, kv_cache, meta, rope)
        out, _ = self.norm(out, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, H] from ``forward``. Returns logits [R, V] float32 (the target's LM
        head, as ``DecoderOnlyLM.compute_logits``)."""
        return self.lm_head(hidden).float()

    def weight_map(self) -> WeightMap:
        """The checkpoint's ``mtp.*`` names -> this rank's parameters."""
        wm = WeightMap(len(self.layers), self.cfg.num_experts)
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            wm.add(f"{PREFIX}{name}.weight", getattr(self, name).weight)
        wm.add(f"{PREFIX}fc.weight", self.fc.weight)
        for i, layer in enumerate(self.layers):
            _map_block(wm, f"{PREFIX}layers.{i}", layer, self.cfg.num_experts)
        return wm

    def load_weights(self, named_tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Copy the ``mtp.*`` tensors in (other names are passed over); ``CheckpointError`` on
        a wrong shape, a layer or expert beyond the config, or any missing tensor."""
        self.weight_map().load((n, t) for n, t in named_tensors if n.startswith(PREFIX))


def _map_block(wm: WeightMap, prefix: str, layer: HybridDecoderLayer, num_experts: int) -> None:
    """One ``mtp.layers.{i}`` block: the names of a target full-attention block."""
    wm.add(f"{prefix}.input_layernorm.weight", layer.input_layernorm.weight)
    wm.add(f"{prefix}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
    map_gated_attention(wm, f"{prefix}.self_attn", layer.mixer)
    ffn, p = layer.ffn, f"{prefix}.mlp"
    if isinstance(ffn, DenseMLP):
        map_dense_mlp(wm, p, ffn)
        return
    wm.add(f"{p}.gate.weight", ffn.routed.gate.weight)
    map_experts(wm, f"{p}.experts", ffn.routed.experts, num_experts,
                ("gate_proj", "up_proj", "down_proj"), fused_prefix=f"{p}.experts")
    map_dense_mlp(wm, f"{p}.shared_expert", ffn.shared_expert)
    wm.add(f"{p}.shared_expert_gate.weight", ffn.shared_expert_gate.weight)


# --------------------------------------------------------------------------- checkpoint


def _config_dicts(path: Path) -> list[dict]:
    """config.json, then its ``text_config`` when it has one (a multimodal checkpoint)."""
    cfg_file = path / "config.json"
    try:
        d = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {cfg_file}: {e!r}") from e
    text = d.get("text_config")
    return [d, text] if isinstance(text, dict) else [d]


def declared_mtp_layers(path: str | Path) -> int | None:
    """The MTP layer count that ``path/config.json`` declares (``LAYER_COUNT_FIELDS``), or
    None when it declares none. ``CheckpointError`` when the head needs MTP-only embeddings
    (``mtp_use_dedicated_embeddings``), which no published checkpoint uses."""
    found = None
    for d in _config_dicts(Path(path)):
        if d.get("mtp_use_dedicated_embeddings"):
            raise CheckpointError("config.json: mtp_use_dedicated_embeddings=True is not "
                                  "supported (the MTP head shares the target's embeddings)")
        for key in LAYER_COUNT_FIELDS:
            value = d.get(key)
            if value is not None:
                if not isinstance(value, int) or value < 0:
                    raise CheckpointError(f"config.json: {key}={value!r} must be an integer >= 0")
                found = value
    return found


def mtp_tensor_files(path: str | Path) -> dict[Path, list[str]]:
    """The checkpoint's ``mtp.*`` tensor names by the safetensors file holding them (a
    sharded checkpoint's index says which shards; only those are opened later)."""
    from safetensors import safe_open

    path = Path(path)
    files = safetensors_files(path)
    index = path / INDEX_FILE
    out: dict[Path, list[str]] = {}
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for name, shard in sorted(weight_map.items()):
            if name.startswith(PREFIX):
                out.setdefault(path / shard, []).append(name)
        return out
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = [n for n in f.keys() if n.startswith(PREFIX)]
        if names:
            out[file] = names
    return out


def _iter_tensors(files: dict[Path, list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file, names in files.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names:
                yield name, f.get_tensor(name)


def load_mtp_head(folder: str | Path, cfg: ModelConfig, target_model: nn.Module, *,
                  dtype: torch.dtype, device: torch.device | str,
                  parallel: ParallelInfo = ParallelInfo(), load_format: str = "auto") -> MtpHead:
    """The MTP head of the checkpoint at ``folder`` for this rank, over ``target_model``'s
    ``embed_tokens`` and ``lm_head`` (the target loaded from the same folder with ``cfg``),
    its parameters in ``dtype`` on ``device``, in eval mode with no grads.

    ``load_format="dummy"`` gives random weights (the declared layer count, or 1) as
    ``load_model`` does. ``CheckpointError`` when the checkpoint has no ``mtp.*`` tensors or
    declares 0 MTP layers, and on any wrong, missing or unexpected MTP tensor.
    """
    path = Path(folder)
    if not path.is_dir():
        raise CheckpointError(f"model path {path} is not a directory")
    declared = declared_mtp_layers(path)
    files: dict[Path, list[str]] = {}
    if load_format != "dummy":
        files = mtp_tensor_files(path)
        if not files:
            raise CheckpointError(f"{path} has no MTP head: its safetensors hold no {PREFIX}* "
                                  "tensors (method 'mtp' needs a checkpoint that ships them)")
    if declared == 0:
        raise CheckpointError(f"{path}/config.json declares 0 MTP layers")
    if declared is None:
        found = {int(m.group(1)) for names in files.values() for n in names
                 if (m := _LAYER_RE.match(n))}
        declared = max(found) + 1 if found else 1
    device = torch.device(device)
    with device, default_dtype(dtype):
        head = MtpHead(cfg, target_model.embed_tokens, target_model.lm_head, declared, parallel)
    if load_format == "dummy":
        init_dummy_weights(head)
    else:
        head.load_weights(_iter_tensors(files))
    return head.eval().requires_grad_(False)
