"""A one-time correctness check of a CUDA backend on the GPU it is about to run on.

The CUDA backends call private aten ops and the flash-attn package, whose signatures
and conventions have moved between releases. Before a backend serves its first call for
a (device, dtype), it runs small causal and full calls, square and not, with GQA,
forward and backward, against the ``math`` backend; if it raises or disagrees, it is
reported unsupported (with the reason) and ``auto`` moves on to the next backend.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from usp.kernels.spec import AttentionSpec

# generous: catches wrong layouts, masks and LSE conventions, not bf16 rounding
_TOLERANCE = {torch.float16: 5e-2, torch.bfloat16: 5e-2, torch.float32: 1e-3}


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    finite = torch.isfinite(expected)
    if not torch.equal(torch.isfinite(actual), finite):
        return float("inf")
    diff = (actual.float() - expected.float()).masked_fill(~finite, 0).abs().max().item()
    return diff / max(expected.float().masked_fill(~finite, 0).abs().max().item(), 1e-6)


@functools.cache
def self_check(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    from usp.kernels.api import dense_backward, dense_forward
    from usp.kernels.backends import registry

    impl, reference = registry.get(name), registry.get("math")
    gen = torch.Generator().manual_seed(1234)
    try:
        for seqlen_q, seqlen_k, causal in ((64, 64, True), (48, 80, True), (64, 64, False)):
            spec = AttentionSpec(1, seqlen_q, seqlen_k, 4, 2, 64, dtype, device, causal, None)
            q = torch.randn(1, seqlen_q, 4, 64, generator=gen).to(device, dtype)
            k, v = (
                torch.randn(1, seqlen_k, 2, 64, generator=gen).to(device, dtype) for _ in range(2)
            )
            dout = torch.randn(1, seqlen_q, 4, 64, generator=gen).to(device, dtype)
            ref_spec = dataclasses.replace(spec, dtype=torch.float32)
            upcast = [t.float() for t in (q, k, v, dout)]
            ref_out, ref_lse = dense_forward(reference, *upcast[:3], ref_spec, 0.125)
            ref_grads = dense_backward(
                reference, upcast[3], *upcast[:3], ref_out, ref_lse, ref_spec, 0.125
            )
            out, lse = dense_forward(impl, q, k, v, spec, 0.125)
            grads = dense_backward(impl, dout, q, k, v, ref_out.to(dtype), ref_lse, spec, 0.125)
            for what, actual, expected in zip(
                ("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (ref_out, ref_lse, *ref_grads)
            ):
                err = _relative(actual, expected)
                if err > _TOLERANCE[dtype]:
                    return (
                        f"failed its self-check on this GPU ({what} off by {err:.2g} relative, "
                        f"Sq={seqlen_q}, Sk={seqlen_k}, causal={causal})"
                    )
    except Exception as err:  # any failure means: do not use this backend here
        return f"failed its self-check on this GPU ({type(err).__name__}: {str(err)[:200]})"
    return None
