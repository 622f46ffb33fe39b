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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("residual,n,k", [(True, 40, 96), (False, 9, 300), (True, 64, 20)],
                         ids=lambda v: str(v))
def test_add_norm_gemv_matches_the_norm_then_the_gemv(residual, n, k, dtype, monkeypatch):
    """A block's zero-centred input norm in the GEMV's launch (the attention projection of the
    hybrids at one row): the norm's own launch then the GEMV's (interpreted), and the
    references; the new residual is the sum (or the input itself); the entry takes it at one
    row and gives the two ops' result at two."""
    from epserve.kernels.linear import add_norm_linear
    from epserve.kernels.norm import (fused_add_zero_centred_rms_norm_ref,
                                      zero_centred_rms_norm_ref)
    norm_k = interpreted_modules("norm")[0]
    use_interpreted(monkeypatch, ("linear", "norm"), (lt, norm_k))
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    res = torch.randn(1, k, generator=g).to(dtype) if residual else None
    nw = (0.2 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    out, new_res = lt.add_norm_gemv_triton(x, res, nw, 1e-6, w)
    if residual:
        normed, two_res = norm_k.fused_add_rms_norm_triton(x, res, nw, 1e-6, zero_centred=True)
        assert torch.equal(new_res, two_res)
    else:
        normed = norm_k.rms_norm_triton(x, nw, 1e-6, zero_centred=True)
        assert new_res is x
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), lt.linear_gemv_triton(normed, w).float(), **tol)
    ref_in = (zero_centred_rms_norm_ref(x, nw, 1e-6) if res is None else
              fused_add_zero_centred_rms_norm_ref(x, res, nw, 1e-6)[0])
    torch.testing.assert_close(out.float(), linear_ref(ref_in, w).float(), **tol)
    two_rows = torch.cat([x, x])  # not one row: the two ops
    got, _ = add_norm_linear(two_rows, None if res is None else torch.cat([res, res]), nw, 1e-6,
                             w)
    torch.testing.assert_close(got[:1].float(), out.float(), **tol)


def test_add_norm_gemv_refuses_what_it_cannot_run():
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="norm_weight"):
        lt.add_norm_gemv_triton(x, None, torch.zeros(4), 1e-6, w)
    with pytest.raises(ValueError, match="share"):
        lt.add_norm_gemv_triton(x, torch.randn(1, 8).double(), torch.zeros(8), 1e-6, w)
