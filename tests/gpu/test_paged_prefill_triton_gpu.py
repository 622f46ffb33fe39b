"""Triton paged prefill attention on CUDA in bf16 against the fp32 reference, Qwen3-30B-like
shapes (Hq=32, Hkv=4, D=128, block_size=16); max abs error < 2e-2. Prints kernel vs ref time
and the kernel's TFLOP/s (causal FLOPs actually needed: 4 * D * Hq per visible (row, key)),
and a small sweep of launch configs so the defaults can be checked on new hardware: every config
of the sweep must run and be correct (at D=128 in bf16 each needs at most 64 KB of shared
memory, compiled for sm_90 by Triton 3.9, of the H200's 227 KB); a config a new device or Triton
cannot run fails the test, to be excluded from ``SWEEP`` by its parameters."""

from __future__ import annotations

import pytest
import torch
from gpu_timing import cuda_ms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")

from epserve.kernels import attention  # noqa: E402
from epserve.kernels.attention import AttentionMetadata, paged_attention, paged_attention_ref  # noqa: E402
from epserve.kernels.triton.paged_prefill import (  # noqa: E402
    INTERPRETED, build_tile_map, paged_prefill_attention, tokens_per_tile)

if INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: the kernel would run in the interpreter", allow_module_level=True)

HQ, HKV, D, BS = 32, 4, 128, 16
DEV = torch.device("cuda")

# name -> (KV length of each sequence, its new rows this step)
CASES = {
    "1x2048": ([2048], [2048]),
    "8x512": ([512] * 8, [512] * 8),
    "chunk512@1536": ([2048], [512]),
    "mixed_64dec+chunk512": ([1000 + 7 * i for i in range(64)] + [1536], [1] * 64 + [512]),
}


def _case(lens: list[int], ns: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    s = len(lens)
    max_blocks = max(-(-n // BS) for n in lens)
    nb = s * max_blocks + 8
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(s, max_blocks, dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // BS)
        tables[i, :used] = perm[i * max_blocks: i * max_blocks + used].int()
    qsl = [0]
    for n in ns:
        qsl.append(qsl[-1] + n)
    k_cache = torch.randn(nb, BS, HKV, D, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn(nb, BS, HKV, D, device=DEV, dtype=torch.bfloat16)
    q = torch.randn(qsl[-1], HQ, D, device=DEV, dtype=torch.bfloat16)
    meta = AttentionMetadata(slot_mapping=torch.full((qsl[-1],), -1, dtype=torch.long, device=DEV),
                             query_start_loc=tuple(qsl), seq_lens=tuple(lens),
                             block_tables=tables.to(DEV), block_size=BS)
    return q, k_cache, v_cache, meta


def _flops(meta: AttentionMetadata, window: int | None) -> float:
    keys = 0
    for s, seq_len in enumerate(meta.seq_lens):
        n = meta.query_start_loc[s + 1] - meta.query_start_loc[s]
        keys += sum(min(p + 1, window or p + 1) for p in range(seq_len - n, seq_len))
    return 4.0 * D * HQ * keys


def _time_ms(fn, iters: int) -> float:
    return cuda_ms(fn, iters, warmup=1)


def _tiles(meta, block_m=128):
    return build_tile_map(meta.query_start_loc, meta.seq_lens, tokens_per_tile(HQ, HKV, block_m),
                          DEV)


def _max_err(out, q, k_cache, v_cache, meta, scale, window):
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale, window)
    return (out.float() - ref).abs().max().item()


# Every case without a window; the window is timed on one case.
WINDOWED = [(name, None) for name in CASES] + [("1x2048", 512)]


@pytest.mark.parametrize("name,window", WINDOWED,
                         ids=[f"{n}-{'full' if w is None else f'window{w}'}" for n, w in WINDOWED])
def test_bf16_prefill_kernel_matches_fp32_ref(name, window):
    q, k_cache, v_cache, meta = _case(*CASES[name], seed=len(name))
    scale = D ** -0.5
    tiles = _tiles(meta)

    def run():
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, tiles, scale,
                                       window)

    out = run()
    err = _max_err(out, q, k_cache, v_cache, meta, scale, window)
    assert out.dtype == torch.bfloat16
    assert err < 2e-2, f"{name} window={window}: max abs error {err}"

    t_kernel = _time_ms(run, iters=20)
    t_ref = _time_ms(lambda: paged_attention_ref(q, k_cache, v_cache, meta, scale, window), iters=3)
    tflops = _flops(meta, window) / (t_kernel * 1e-3) / 1e12
    print(f"\npaged prefill {name} window={window} rows={q.shape[0]}: triton {t_kernel:.3f} ms "
          f"({tflops:.0f} TFLOP/s), ref {t_ref:.3f} ms ({t_ref / t_kernel:.1f}x), "
          f"max abs err {err:.2e}")


def test_dispatch_runs_kernel_on_cuda(monkeypatch):
    q, k_cache, v_cache, meta = _case(*CASES["mixed_64dec+chunk512"], seed=3)
    want = paged_attention_ref(q, k_cache, v_cache, meta, 0.1)

    def no_ref(*args, **kwargs):
        raise AssertionError("paged_attention fell back to the reference on a mixed batch")

    monkeypatch.setattr(attention, "paged_attention_ref", no_ref)
    out = paged_attention(q, k_cache, v_cache, meta, 0.1)
    assert (out.float() - want.float()).abs().max().item() < 2e-2


# (block_m, block_n, num_warps, num_stages): every one must run (see the module docstring).
SWEEP = [(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]


@pytest.mark.parametrize("name", ["1x2048", "8x512"])
def test_launch_config_sweep(name):
    """Prints ms per (block_m, block_n, num_warps, num_stages); every config must be correct."""
    q, k_cache, v_cache, meta = _case(*CASES[name], seed=11)
    scale = D ** -0.5
    flops = _flops(meta, None)
    lines = []
    tiles = {block_m: _tiles(meta, block_m) for block_m in {m for m, _, _, _ in SWEEP}}
    for block_m, block_n, warps, stages in SWEEP:
        def run():
            return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables,
                                           tiles[block_m], scale, None, block_n=block_n,
                                           num_warps=warps, num_stages=stages)
        cfg = f"M={block_m:3d} N={block_n:3d} w={warps} s={stages}"
        err = _max_err(run(), q, k_cache, v_cache, meta, scale, None)
        assert err < 2e-2, f"{cfg}: max abs error {err}"
        ms = _time_ms(run, iters=10)
        lines.append(f"{cfg}: {ms:.3f} ms {flops / (ms * 1e-3) / 1e12:.0f} TFLOP/s")
    print(f"\npaged prefill config sweep {name}:\n  " + "\n  ".join(lines))
