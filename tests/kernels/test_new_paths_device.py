"""The 2026 paths on each device the build has: sliding windows, attention sinks and a
value head size of its own through ``usp_attention`` on every backend; the MoE experts'
grouped GEMM against the loop; the gated delta rule's kernel against its recurrence;
fla's gated delta rule (``usp[fla]``, CUDA only) against usp's torch kernel, alone and
under ``gated_deltanet_usp``, and causal-conv1d's short conv against torch's conv1d.

On CPU these run in the suite (they check the cases themselves); the CUDA cases are
marked ``cuda`` and run in ``benchmarks/gpu_check.sh`` (``kernel_tests``), where they are
the first run of these paths on a GPU. Tolerances are relative to the largest reference
magnitude, as in ``test_kernels.py``; the CUDA ones are not yet measured on a GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from kernel_cases import BACKENDS, require, work_dtype
from reference import reference_sink_attention, relative_error, window_document_mask

import usp
from usp.kernels import AttentionSpec
from usp.linear import gated_deltanet_usp
from usp.linear.backends import TorchGdnKernel, select_gdn_kernel
from usp.linear.conv import TorchConvKernel, select_conv_kernel
from usp.linear.kernel import chunk_gated_delta_rule, compute_dtype, recurrent_gated_delta_rule
from usp.models.moe import Experts, experts_loop, grouped_gemm_available

TOLERANCE = {  # (device type, dtype): (out, grads)
    ("cpu", torch.float32): (5e-6, 2e-5),
    ("cpu", torch.bfloat16): (2e-2, 4e-2),
    ("cuda", torch.float32): (5e-5, 2e-4),
    ("cuda", torch.bfloat16): (2e-2, 4e-2),
}


def _cases(backends):
    for device, backend in backends:
        marks = [pytest.mark.cuda] if device == "cuda" else []
        yield pytest.param(device, backend, marks=marks, id=f"{device}-{backend}")


# ------------------------------------------------- windows, sinks, v's own head size
WINDOWED = [  # (window, with sinks, packed boundaries or None, v head dim)
    (1, True, None, 64),
    (37, False, [0, 100, 256], 64),
    (37, True, [0, 100, 256], 64),
    (None, True, None, 64),
    (None, False, None, 32),  # MLA-like: v's head dim below q/k's
    (19, True, [0, 256], 32),
]


@pytest.mark.parametrize(("device", "backend"), list(_cases(BACKENDS)))
def test_windows_sinks_and_value_head_size_on_every_backend(device, backend):
    dtype = work_dtype(device, backend)
    require(backend, AttentionSpec(1, 256, 256, 4, 2, 64, dtype, torch.device(device), True, 37))
    plan = usp.Plan(None)
    generator = torch.Generator().manual_seed(0)
    seq, heads, kv_heads, head_dim = 256, 4, 2, 64
    out_tol, grad_tol = TOLERANCE[device, dtype]
    for window, with_sinks, bounds, v_dim in WINDOWED:
        shapes = [(1, seq, heads, head_dim), (1, seq, kv_heads, head_dim)]
        shapes += [(1, seq, kv_heads, v_dim), (1, seq, heads, v_dim)]
        q, k, v, dout = (torch.randn(*s, generator=generator, dtype=torch.float64) for s in shapes)
        sinks = torch.randn(heads, generator=generator, dtype=torch.float64)
        mask = window_document_mask(bounds or [0, seq], window)
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_sinks = (
            sinks.clone().requires_grad_() if with_sinks else sinks.new_full((heads,), -torch.inf)
        )
        ref_out = reference_sink_attention(*ref_leaves, ref_sinks, mask=mask)
        wanted = [*ref_leaves, ref_sinks] if with_sinks else ref_leaves
        ref_grads = torch.autograd.grad(ref_out, wanted, dout)

        leaves = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
        dev_sinks = sinks.float().to(device).requires_grad_() if with_sinks else None
        cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32, device=device)
        out = usp.usp_attention(
            *leaves, plan, causal=True, backend=backend, window=window, sinks=dev_sinks,
            cu_seqlens=cu,
        )  # fmt: skip
        got = [*leaves, dev_sinks] if with_sinks else leaves
        grads = torch.autograd.grad(out, got, dout.to(device, dtype))
        case = (window, with_sinks, bounds, v_dim)
        assert relative_error(out.double().cpu(), ref_out) <= out_tol, case
        for name, grad, ref in zip(["q", "k", "v", "sinks"], grads, ref_grads):
            assert relative_error(grad.double().cpu(), ref) <= grad_tol, (case, name)


# ----------------------------------------------------------------- MoE experts
def _devices():
    yield pytest.param("cpu", id="cpu")
    yield pytest.param(
        "cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    )  # fmt: skip


@pytest.mark.parametrize("device", list(_devices()))
def test_moe_grouped_experts_equal_the_loop(device):
    """The grouped path (torch._grouped_mm where the device has it: bf16 on Hopper,
    float32/bf16 on CPU) against the per-expert loop, output and gradients."""
    dtype = torch.bfloat16
    if not grouped_gemm_available(dtype, torch.device(device)):
        pytest.fail(f"torch._grouped_mm is expected on {device} for {dtype} here")
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 512, 128, 64, 16, 4
    module = Experts(experts, hidden, inter, top_k).to(device)
    module.init_weights(0.05)
    module = module.to(dtype)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    chosen = torch.rand(tokens, experts, device=device).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=device, dtype=dtype).softmax(-1)
    chosen[:8] = 0  # one crowded expert; with 16 experts some may get no token
    out = module(x, chosen, weights)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, module.gate_up_proj, module.down_proj], dout)

    ref_params = [
        p.detach().double().requires_grad_() for p in (module.gate_up_proj, module.down_proj)
    ]
    ref_x = x.detach().double().requires_grad_()
    ref = experts_loop(ref_x, chosen, weights.double(), *ref_params)
    ref_grads = torch.autograd.grad(ref, [ref_x, *ref_params], dout.double())
    assert relative_error(out.double(), ref) <= 2e-2
    for name, grad, want in zip(("x", "gate_up", "down"), grads, ref_grads):
        assert relative_error(grad.double(), want) <= 4e-2, name


# ----------------------------------------------------------------- Gated DeltaNet
@pytest.mark.parametrize("device", list(_devices()))
def test_gated_delta_rule_kernel_against_its_recurrence(device):
    """The chunked kernel on the device (float32, packed documents, an initial state)
    against the token-by-token recurrence in float64 on the CPU, output, final states
    and gradients."""
    generator = torch.Generator().manual_seed(1)
    seq, key_heads, heads, dk, dv = 96, 2, 4, 32, 48
    bounds = [0, 40, 96]
    q, k = (
        torch.randn(1, seq, key_heads, dk, generator=generator, dtype=torch.float64) for _ in "qk"
    )
    v = torch.randn(1, seq, heads, dv, generator=generator, dtype=torch.float64)
    g = -torch.rand(1, seq, heads, generator=generator, dtype=torch.float64)
    beta = torch.rand(1, seq, heads, generator=generator, dtype=torch.float64)
    state0 = torch.randn(2, heads, dk, dv, generator=generator, dtype=torch.float64) * 0.1
    dout = torch.randn(1, seq, heads, dv, generator=generator, dtype=torch.float64)

    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    outs, states = [], []
    for doc, (a, b) in enumerate(zip(bounds, bounds[1:])):
        o, s = recurrent_gated_delta_rule(
            *(t[:, a:b] for t in leaves), initial_state=state0[doc : doc + 1],
            use_qk_l2norm=True, scale=0.2,
        )  # fmt: skip
        outs.append(o)
        states.append(s)
    ref_out, ref_state = torch.cat(outs, dim=1), torch.cat(states)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)

    dev = [t.to(device, torch.float32).requires_grad_() for t in (q, k, v, g, beta)]
    out, state = chunk_gated_delta_rule(
        *dev, initial_state=state0.to(device, torch.float32), output_final_state=True,
        cu_seqlens=bounds, use_qk_l2norm=True, scale=0.2, chunk_size=16,
    )  # fmt: skip
    grads = torch.autograd.grad(out, dev, dout.to(device, torch.float32))
    tol = 2e-5 if device == "cpu" else 2e-4
    assert relative_error(out.double().cpu(), ref_out) <= tol
    assert relative_error(state.double().cpu(), ref_state) <= tol
    for name, grad, want in zip(["q", "k", "v", "g", "beta"], grads, ref_grads):
        assert relative_error(grad.double().cpu(), want) <= 10 * tol, name


# ------------------------------------------------- fla's kernel (usp[fla]) on CUDA
def _fla_dtypes():
    needs = [
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        pytest.mark.skipif(
            importlib.util.find_spec("fla") is None, reason="needs fla (pip install 'usp[fla]')"
        ),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        yield pytest.param(dtype, marks=needs, id=str(dtype).removeprefix("torch."))


# (out, grads) relative to the float64 torch kernel; not yet measured on a GPU (fla's
# float32 matmuls may run in tf32)
FLA_TOLERANCE = {torch.float32: (5e-3, 1e-2), torch.bfloat16: (3e-2, 6e-2)}


@pytest.mark.parametrize("dtype", list(_fla_dtypes()))
@pytest.mark.parametrize(("dk", "dv"), [(64, 64), (128, 256)])  # 256: dv 128 + the ring's dk
def test_fla_kernel_against_the_torch_kernel(dtype, dk, dv):
    """usp's fla path (rows packed into cu_seqlens, one of them empty, initial states)
    against usp's torch kernel in float64 on the same GPU: output, final states and the
    gradients of q, k, v, g, beta and the initial state. A self-check failure fails."""
    device = torch.device("cuda")
    fla = select_gdn_kernel("fla", device, dtype, dk, dv)  # raises if it fails its self-check
    generator = torch.Generator().manual_seed(3)
    lengths, heads = [300, 0, 77, 128], 4
    n, length = len(lengths), max(lengths)
    valid = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    mask = valid[..., None].double()

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(randn(n, length, heads, dk), dim=-1) for _ in "qk")
    q = q * dk**-0.5
    v = randn(n, length, heads, dv)
    g = -torch.rand(n, length, heads, generator=generator, dtype=torch.float64) * 0.3
    beta = torch.rand(n, length, heads, generator=generator, dtype=torch.float64)
    inputs = [t * mask[..., None] for t in (q, k, v)] + [t * mask for t in (g, beta)]
    state = randn(n, heads, dk, dv) * 0.2
    dout, dstate = randn(n, length, heads, dv) * mask[..., None], randn(n, heads, dk, dv)

    results = []
    for kernel, run_dtype in ((TorchGdnKernel(), torch.float64), (fla, dtype)):
        leaves = [t.to(device, compute_dtype(run_dtype)).requires_grad_() for t in (*inputs, state)]
        o, final = kernel.run(
            *leaves[:5], lengths=lengths, initial_state=leaves[5], chunk_size=64,
            io_dtype=run_dtype,
        )  # fmt: skip
        grads = torch.autograd.grad(
            (o, final), leaves, (dout.to(device, o.dtype), dstate.to(device, final.dtype))
        )
        keep = valid.to(device)
        results.append([o[keep], final, *(t[keep] for t in grads[:5]), grads[5]])
    out_tol, grad_tol = FLA_TOLERANCE[dtype]
    names = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"]
    for name, actual, expected in zip(names, *results[::-1]):
        tol = out_tol if name in ("o", "final") else grad_tol
        assert relative_error(actual.double().cpu(), expected.double().cpu()) <= tol, name


@pytest.mark.parametrize("dtype", list(_fla_dtypes()))
def test_gated_deltanet_on_fla_against_the_torch_kernel(dtype):
    """The whole one-process path (conv, l2-norm, packed documents) with kernel="fla"
    against kernel="torch" in float64, output and every gradient."""
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(4)
    seq, hk, heads, dk, dv = 384, 2, 4, 64, 64
    cu = torch.tensor([0, 100, 101, 384], dtype=torch.int32)
    shapes = [(1, seq, hk, dk), (1, seq, hk, dk), (1, seq, heads, dv)]
    q, k, v = (torch.randn(*s, generator=generator, dtype=torch.float64) for s in shapes)
    g = -torch.rand(1, seq, heads, generator=generator, dtype=torch.float64) * 0.3
    beta = torch.rand(1, seq, heads, generator=generator, dtype=torch.float64)
    ws = [torch.randn(c, 4, generator=generator, dtype=torch.float64) * 0.5
          for c in (hk * dk, hk * dk, heads * dv)]  # fmt: skip
    dout = torch.randn(1, seq, heads, dv, generator=generator, dtype=torch.float64)
    results = []
    for kernel, run_dtype in (("torch", torch.float64), ("fla", dtype)):
        leaves = [t.to(device, run_dtype).requires_grad_() for t in (q, k, v)]
        leaves += [t.to(device, compute_dtype(run_dtype)).requires_grad_() for t in (g, beta)]
        weights = [w.to(device, run_dtype).requires_grad_() for w in ws]
        out = gated_deltanet_usp(
            *leaves, None, conv_weights=weights, packed=cu.to(device), kernel=kernel
        )
        grads = torch.autograd.grad(out, leaves + weights, dout.to(device, run_dtype))
        results.append([out, *grads])
    out_tol, grad_tol = FLA_TOLERANCE[dtype]
    names = ["out", "dq", "dk", "dv", "dg", "dbeta", "dwq", "dwk", "dwv"]
    for name, actual, expected in zip(names, *results[::-1]):
        tol = out_tol if name == "out" else grad_tol
        assert relative_error(actual.double().cpu(), expected.double().cpu()) <= tol, name


def _conv_dtypes():
    needs = [
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        pytest.mark.skipif(
            importlib.util.find_spec("causal_conv1d") is None,
            reason="needs causal-conv1d (pip install 'usp[fla]')",
        ),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        yield pytest.param(dtype, marks=needs, id=str(dtype).removeprefix("torch."))


@pytest.mark.parametrize("dtype", list(_conv_dtypes()))
def test_causal_conv1d_against_the_torch_conv(dtype):
    """causal-conv1d's kernel through usp's mapping (channel-last segments after their
    ring contexts) against torch's conv1d in float64, both activations, forward and the
    gradients of x, the weight and the contexts. A self-check failure fails."""
    device = torch.device("cuda")
    channels, width = 256, 4
    fast = select_conv_kernel("causal_conv1d", device, dtype, channels, width)
    generator = torch.Generator().manual_seed(5)
    x, dout = (
        torch.randn(3, 300, channels, generator=generator, dtype=torch.float64) for _ in "xd"
    )
    context = torch.randn(3, width - 1, channels, generator=generator, dtype=torch.float64)
    weight = torch.randn(channels, width, generator=generator, dtype=torch.float64) * 0.5
    out_tol, grad_tol = FLA_TOLERANCE[dtype]
    for activation in ("silu", None):
        results = []
        for kernel, run_dtype in ((TorchConvKernel(), torch.float64), (fast, dtype)):
            leaves = [
                t.to(device, compute_dtype(run_dtype)).requires_grad_()
                for t in (x, weight, context)
            ]
            out = kernel.run(*leaves, activation, io_dtype=run_dtype)
            grads = torch.autograd.grad(out, leaves, dout.to(device, out.dtype))
            results.append([out, *grads])
        for name, actual, expected in zip(["out", "dx", "dweight", "dcontext"], *results[::-1]):
            tol = out_tol if name == "out" else grad_tol
            err = relative_error(actual.double().cpu(), expected.double().cpu())
            assert err <= tol, (name, activation)


@pytest.mark.parametrize("dtype", list(_fla_dtypes()))
def test_mamba2_on_fla_simple_gla_against_the_torch_kernel(dtype):
    """Mamba-2's one-process path (conv with bias, groups, D skip, packed documents) with
    kernel="fla" (fla's simple GLA, usp.linear.scan_backends; its self-check runs first)
    against kernel="torch" in float64, output and every gradient. Not yet run on a GPU."""
    from mamba_cases import mamba_inputs

    from usp.linear.mamba2 import mamba2_usp

    device = torch.device("cuda")
    inputs, dout = mamba_inputs(1, 384, 8, 2, 64, 128, 4, seed=6)  # H 8, G 2, P 64, N 128
    cu = torch.tensor([0, 100, 101, 384], dtype=torch.int32)
    results = []
    for kernel, run_dtype in (("torch", torch.float64), ("fla", dtype)):
        leaves = [t.to(device, run_dtype).requires_grad_() for t in inputs[:3]]
        leaves += [t.to(device, compute_dtype(run_dtype)).requires_grad_() for t in inputs[3:]]
        x, b, c, dt, a, d, weight, bias = leaves
        out = mamba2_usp(x, b, c, dt, a, None, d=d, conv_weight=weight, conv_bias=bias,
                         packed=cu.to(device), kernel=kernel)  # fmt: skip
        grads = torch.autograd.grad(out, leaves, dout.to(device, out.dtype))
        results.append([out, *grads])
    out_tol, grad_tol = FLA_TOLERANCE[dtype]
    names = ["out", "dx", "db", "dc", "ddt", "da", "dd", "dweight", "dbias"]
    for name, actual, expected in zip(names, *results[::-1]):
        tol = out_tol if name == "out" else grad_tol
        assert relative_error(actual.double().cpu(), expected.double().cpu()) <= tol, name
