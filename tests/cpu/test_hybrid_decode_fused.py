"""The hybrids' whole decode path as CUDA runs it (every Triton kernel in the interpreter, on
CPU), held to transformers fp32 at 1e-4 like the reference path: a prompt, then decode steps
in a CUDA graph's form (device lengths) of one row (the fused launches: the shared expert in
two, with the routed experts' combine in the second; the DeltaNet's conv and gated norm inside
its projections) and of two rows (the combine's launch, then the shared expert's elementwise
launches between its projections).

Under EP (two ranks in one process, ``fake_ep``) the routed output still comes back through the
exchange combined, each rank's combine its own launch, and the logits are one rank's.

And what a batch-1 decode forward launches, counted as bench/count_decode_launches.py counts
it: no eager op but the embedding and the step's fresh-sequence mask, and 9 Triton launches a
layer of either kind, none of them the MoE's combine (issue 17: 18 a DeltaNet layer and 16 an
attention layer before session 14, 10 each before session 15).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from kernel_interp import HAS_TRITON, interpreted_modules, use_interpreted

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import paged_runner  # noqa: E402
from epserve.kernels.attention import AttentionMetadata  # noqa: E402
from epserve.models.loader import load_model  # noqa: E402
from epserve.models.parallel import ParallelInfo  # noqa: E402
from fake_ep import LoopbackComm, RecordingComm  # noqa: E402
from paged_runner import PagedRunner, Schedule, prompts  # noqa: E402
from tiny_ckpt import make_tiny_checkpoint  # noqa: E402

_NAMES = ("norm", "linear", "causal_conv_update", "gated_delta_decode", "rope", "rope_decode",
          "paged_attention", "paged_prefill", "kv_write", "deltanet_proj", "shared_expert",
          "norm_router", "router", "fused_moe", "moe_align")
_MODS = interpreted_modules(*_NAMES)
ATOL = 1e-4
#: aten ops that launch nothing on a GPU (views, allocations)
_NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "split", "split_with_sizes", "t",
              "transpose", "unsqueeze", "squeeze", "expand", "as_strided", "detach", "alias",
              "empty", "empty_like", "empty_strided", "reshape", "unflatten"}


def _graph_meta(slot_mapping, qsl, seq_lens, table, block_size, **kw):
    """The runner's metadata, with device lengths on a pure decode step (as a CUDA graph's)."""
    decode = tuple(qsl) == tuple(range(len(qsl)))
    lens = torch.tensor(seq_lens, dtype=torch.int32) if decode else None
    return AttentionMetadata(slot_mapping, qsl, seq_lens, table, block_size, seq_lens_t=lens,
                             **kw)


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_next"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def models(ckpt):
    import transformers

    path = ckpt
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    ours, cfg = load_model(path, dtype=torch.float32, device="cpu")
    return hf, ours, cfg


@pytest.fixture
def cuda_path(monkeypatch):
    use_interpreted(monkeypatch, _NAMES, _MODS)
    monkeypatch.setattr(paged_runner, "AttentionMetadata", _graph_meta)


def test_decode_on_the_kernels_matches_transformers(models, cuda_path):
    """Two sequences decoded together (the batched kernels), then one of them alone (batch 1:
    the GEMV and fused one-row paths), against transformers on every position."""
    hf, ours, cfg = models
    seqs = dict(zip("ab", prompts(cfg.vocab_size, [7, 5], seed=2)))
    sched = Schedule(PagedRunner(ours, cfg, seed=2), seqs)
    sched.run(list(seqs.items()))  # the prompts, one prefill step
    for names in ("ab", "ab", "a", "a"):
        sched.run([sched.decode(name) for name in names])
    sched.check(hf, ATOL)


@pytest.mark.parametrize("ckpt", ["qwen3_5_moe"], indirect=True)  # one MoE block for both
def test_a_batch_1_decode_under_ep_keeps_the_exchange(ckpt, models, cuda_path, monkeypatch):
    _, ours, cfg = models
    fmt, sek = (_MODS[_NAMES.index(n)] for n in ("fused_moe", "shared_expert"))
    calls = []
    for mod, name in ((fmt, "combine_pairs_triton"), (sek, "shared_expert_pairs_triton")):
        monkeypatch.setattr(mod, name, lambda *a, _r=getattr(mod, name), _n=name:
                            calls.append(_n) or _r(*a))

    def decode(model):  # a prompt, then one batch-1 decode step: its logits
        runner = PagedRunner(model, cfg)
        runner.step([("a", [5, 6, 7])])
        calls.clear()
        return runner.step([("a", [8])])["a"]

    want = decode(ours)
    assert "combine_pairs_triton" not in calls and "shared_expert_pairs_triton" in calls
    recorder = RecordingComm()
    rank1, _ = load_model(ckpt, dtype=torch.float32, device="cpu",
                          parallel=ParallelInfo(rank=1, world_size=2, ep_comm=recorder))
    decode(rank1)
    rank0, _ = load_model(ckpt, dtype=torch.float32, device="cpu", parallel=ParallelInfo(
        rank=0, world_size=2, ep_comm=LoopbackComm(recorder.local_fns)))
    got = decode(rank0)
    moe_layers = sum(hasattr(layer.ffn, "routed") for layer in rank0.layers)
    assert calls == ["combine_pairs_triton"] * 2 * moe_layers  # each rank's, none fused
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


class _Count(TorchDispatchMode):
    """Eager ops that launch a kernel, outside the interpreter's own launches."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.in_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.in_kernel and name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def test_a_batch_1_decode_forward_launches(models, cuda_path, monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    _, ours, cfg = models
    runner = PagedRunner(ours, cfg)
    runner.step([("a", [5, 6, 7])])
    count, launches = _Count(), Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[self.fn.__name__] += 1
        count.in_kernel += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            count.in_kernel -= 1

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    forward = ours.forward

    def counted_forward(*args):  # the forward only, not the logits after it
        with count:
            return forward(*args)

    monkeypatch.setattr(ours, "forward", counted_forward)
    runner.step([("a", [8])])
    assert set(count.ops) <= {"embedding", "eq"}, count.ops
    layers = len(cfg.layer_types)
    attention = cfg.layer_types.count("full_attention")
    deltanet = layers - attention  # (+1: the gated norm before the output projection)
    assert sum(launches.values()) == 9 * layers + deltanet + 1, launches  # + the final norm
    assert "_combine_kernel" not in launches, launches  # in the shared expert's epilogue
    # plain GEMVs: attention's two projections, the DeltaNet's output projection (its input
    # projection carries the conv)
    assert launches["_gemv_kernel"] == 2 * attention + deltanet, launches
    assert launches["_in_proj_conv_kernel"] == launches["_gated_rms_norm_kernel"] == \
        deltanet and launches["_swiglu_down_kernel"] == layers, launches
