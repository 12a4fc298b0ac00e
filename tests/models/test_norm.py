"""usp.models.norm.rms_norm (the Llama RMSNorm's forward and hand-written backward, over
token tiles) against autograd through the plain formula, and what its backward holds.

Untiled: output, input gradient and weight gradient bit-equal to autograd's in float64,
float32 and bf16, with the weight in the input's dtype or in float32 (mixed precision).
Tiled: output and input gradient bit-equal (every token is computed alone); the weight
gradient, summed over tiles in float32, within 1e-6 relative (1e-12 in float64).
"""

from __future__ import annotations

import pytest
import torch
from model_cases import relative_error
from usp_cases import load_benchmark

from usp.models.norm import RMSNorm, rms_norm, rms_norm_reference

profiled_peak = load_benchmark("levers_memory").profiled_peak


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _grads(fn, x, w, g):
    y = fn(x, w)
    return (y, *torch.autograd.grad(y, (x, w), g))


CASES = [
    (torch.float64, torch.float64),
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float64, torch.float32),
]


@pytest.mark.parametrize("dtype, weight_dtype", CASES)
@pytest.mark.parametrize("chunk", [1 << 20, 7, 1])
def test_rms_norm_equals_autograd_through_the_formula(dtype, weight_dtype, chunk):
    torch.manual_seed(0)
    x = torch.randn(2, 33, 48, dtype=dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(48)).to(weight_dtype).requires_grad_()
    g = torch.randn(2, 33, 48, dtype=torch.promote_types(dtype, weight_dtype))
    want = _grads(lambda a, b: rms_norm_reference(a, b, 1e-5), x, w, g)
    got = _grads(lambda a, b: rms_norm(a, b, 1e-5, chunk), x, w, g)
    assert [t.dtype for t in got] == [t.dtype for t in want]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if chunk >= 66:  # one tile: the weight gradient too
        assert torch.equal(got[2], want[2])
    else:
        tol = 1e-12 if dtype == torch.float64 == weight_dtype else 1e-6
        assert relative_error(got[2], want[2]) <= tol


def test_only_the_gradients_asked_for_are_computed():
    x = torch.randn(4, 16, requires_grad=True)
    w = torch.ones(16)
    (dx,) = torch.autograd.grad(rms_norm(x, w, 1e-6, 3).sum(), (x,))
    (want,) = torch.autograd.grad(rms_norm_reference(x, w, 1e-6).sum(), (x,))
    assert torch.equal(dx, want)
    w.requires_grad_()
    (dw,) = torch.autograd.grad(rms_norm(x.detach(), w, 1e-6, 3).sum(), (w,))
    (want,) = torch.autograd.grad(rms_norm_reference(x.detach(), w, 1e-6).sum(), (w,))
    assert relative_error(dw, want) <= 1e-6
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def test_bad_chunk_names_the_valid_values():
    with pytest.raises(ValueError, match="chunk_tokens must be an integer >= 1, got 0"):
        rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6, 0)


def test_the_backward_holds_a_tile_of_float32_not_the_whole_input():
    """bf16 [4096, 512] on the CPU, forward + backward, peak from torch.profiler's memory
    events: the formula through autograd holds float32 copies of the input's size (four
    at once in its backward: 8 MiB each), the module one tile's worth; the input and its
    gradient (4 MiB each in bf16) are in both."""
    tokens, dim = 4096, 512  # 16 tiles of 256 tokens
    norm = RMSNorm(dim, 1e-5).to(torch.bfloat16)
    x = torch.randn(1, tokens, dim, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)

    def step(fn):
        def run():
            fn(x).backward(grad)
            x.grad = None

        return run

    plain = profiled_peak(step(lambda t: rms_norm_reference(t, norm.weight, norm.eps)))
    tiled = profiled_peak(step(lambda t: rms_norm(t, norm.weight, norm.eps, 256)))
    wide = tokens * dim * 4  # one float32 copy of the input
    assert plain >= 4 * wide, plain
    assert tiled <= 1.5 * wide, tiled  # the output, the input gradient, tiles, rstd
