"""The one-row Triton GEMV (interpreter on CPU) against ``linear_ref``, the public ``linear``'s
choice of path, and its argument errors.

Bar: float32 within 1e-5 relative of the float32 reference (only the summation order differs);
fp16 within one unit in the last place of the output scale.
"""

from __future__ import annotations

import pytest
from kernel_interp import HAS_TRITON, interpreted_modules, use_interpreted

if not HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from epserve.kernels.linear import linear, linear_ref  # noqa: E402

_NAMES = ("linear",)
_MODS = interpreted_modules(*_NAMES)
lt, = _MODS
assert lt.INTERPRETED and type(lt._gemv_kernel).__name__ == "InterpretedFunction"


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    use_interpreted(monkeypatch, _NAMES, _MODS)


@pytest.mark.parametrize("n,k,bn,bk", [(64, 128, None, None), (37, 96, 8, 32), (5, 300, 4, 64),
                                       (16, 16, 16, 16)])
def test_fp32_matches_reference(n, k, bn, bk):
    g = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(1, k, generator=g), torch.randn(n, k, generator=g)
    got = lt.linear_gemv_triton(x, w, block_n=bn, block_k=bk)
    torch.testing.assert_close(got, linear_ref(x, w), rtol=1e-5, atol=1e-5)


def test_fp16_matches_reference():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 256, generator=g).half(), (torch.randn(48, 256, generator=g) / 16).half()
    got = lt.linear_gemv_triton(x, w)
    torch.testing.assert_close(got.float(), linear_ref(x, w).float(), rtol=2e-3, atol=2e-3)


def test_strided_weight_rows():
    """A weight whose rows are a slice of a wider tensor (row stride > K) is read correctly."""
    g = torch.Generator().manual_seed(2)
    big = torch.randn(24, 80, generator=g)
    w = big[:, :64]
    x = torch.randn(1, 64, generator=g)
    torch.testing.assert_close(lt.linear_gemv_triton(x, w), linear_ref(x, w), rtol=1e-5, atol=1e-5)


def test_public_entry_uses_the_gemv_for_one_row_only(monkeypatch):
    calls = []
    real = lt.linear_gemv_triton
    monkeypatch.setattr(lt, "linear_gemv_triton", lambda x, w: calls.append(x.shape[0]) or real(x, w))
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g)
    for m in (1, 3):
        x = torch.randn(m, 64, generator=g)
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert calls == [1]


@pytest.mark.parametrize("x_shape,w_shape,dtype,match", [
    ((2, 64), (32, 64), torch.float32, "one row"),
    ((1, 64), (32, 63), torch.float32, r"\[N, K\]"),
    ((1, 64), (32, 64), torch.int32, "share one of"),
])
def test_bad_arguments_raise(x_shape, w_shape, dtype, match):
    x = torch.ones(x_shape, dtype=dtype)
    w = torch.ones(w_shape, dtype=torch.float32 if dtype == torch.int32 else dtype)
    with pytest.raises(ValueError, match=match):
        lt.linear_gemv_triton(x, w)
