"""Triton paged decode attention on CUDA in bf16 against the fp32 reference, Qwen3-30B-like
shapes (Hq=32, Hkv=4, D=128, block_size=16); max abs error < 2e-2. Prints kernel vs ref timing."""

from __future__ import annotations

import pytest
import torch
from gpu_timing import cuda_ms

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("triton")

from epserve.kernels.attention import AttentionMetadata, paged_attention_ref  # noqa: E402
from epserve.kernels.triton.paged_attention import INTERPRETED, paged_decode_attention  # noqa: E402

if INTERPRETED:
    pytest.skip("TRITON_INTERPRET=1: the kernel would run in the interpreter", allow_module_level=True)

HQ, HKV, D, BS = 32, 4, 128, 16


def _case(s: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(100, 2001, (s,), generator=g)]
    max_blocks = max(-(-n // BS) for n in lens)
    nb = s * max_blocks + 8
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(s, max_blocks, dtype=torch.int32)
    for i, n in enumerate(lens):
        used = -(-n // BS)
        tables[i, :used] = perm[i * max_blocks: i * max_blocks + used].int()
    dev = "cuda"
    k_cache = torch.randn(nb, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn(nb, BS, HKV, D, device=dev, dtype=torch.bfloat16)
    q = torch.randn(s, HQ, D, device=dev, dtype=torch.bfloat16)
    meta = AttentionMetadata(slot_mapping=torch.full((s,), -1, dtype=torch.long, device=dev),
                             query_start_loc=tuple(range(s + 1)), seq_lens=tuple(lens),
                             block_tables=tables.to(dev), block_size=BS)
    return q, k_cache, v_cache, meta


def _time_ms(fn, iters: int) -> float:
    return cuda_ms(fn, iters, warmup=1)


@pytest.mark.parametrize("window", [None, 512], ids=["full", "window512"])
@pytest.mark.parametrize("s", [1, 32, 256])
def test_bf16_decode_kernel_matches_fp32_ref(s, window):
    q, k_cache, v_cache, meta = _case(s, seed=s)
    scale = D ** -0.5
    sl = torch.tensor(meta.seq_lens, dtype=torch.int32, device="cuda")
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, sl, scale, window)
    ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale, window)
    err = (out.float() - ref).abs().max().item()
    assert out.dtype == torch.bfloat16
    assert err < 2e-2, f"S={s} window={window}: max abs error {err}"

    t_kernel = _time_ms(lambda: paged_decode_attention(q, k_cache, v_cache, meta.block_tables,
                                                       sl, scale, window), iters=50)
    t_ref = _time_ms(lambda: paged_attention_ref(q, k_cache, v_cache, meta, scale, window),
                     iters=3 if s > 32 else 10)
    print(f"\npaged decode S={s} window={window} tokens={sum(meta.seq_lens)}: "
          f"triton {t_kernel:.3f} ms, ref {t_ref:.3f} ms ({t_ref / t_kernel:.1f}x), "
          f"max abs err {err:.2e}")
