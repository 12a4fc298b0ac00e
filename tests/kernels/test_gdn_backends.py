"""The Gated DeltaNet kernels (usp.linear.backends, usp.linear.conv) on the CPU: which kernel a call
gets (fla absent, fla present off CUDA, a forced one that cannot run), the self-check
refusing a kernel that is wrong in one way, and the mapping of usp's padded rows onto
fla's (and causal-conv1d's) documented arguments, against stand-ins with their
signatures (fla_standin.py). The packages themselves run only in the GPU check
(test_new_paths_device.py)."""

from __future__ import annotations

import pytest
import torch
from fla_standin import (
    CONV_DEFECTS,
    DEFECTS,
    CausalConv1dStandIn,
    FlaStandIn,
    standin_conv_kernel,
    standin_kernel,
)
from gdn_cases import gdn_inputs, reference_gdn
from reference import relative_error

from usp.linear import GatedDeltaNet, gated_deltanet_usp
from usp.linear.backends import (
    FlaGdnKernel,
    GdnKernelError,
    GdnKernels,
    TorchGdnKernel,
    select_gdn_kernel,
)
from usp.linear.conv import (
    CausalConv1dKernel,
    ConvKernelError,
    TorchConvKernel,
    select_conv_kernel,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _kernels(fla) -> GdnKernels:
    return GdnKernels(TorchGdnKernel(), fla)


def test_absent_fla_leaves_the_torch_kernel_and_a_forced_one_says_what_to_install():
    kernels = _kernels(FlaGdnKernel(module="usp_test_no_such_package.ops"))
    for device in (CPU, CUDA):  # the device is only compared: no CUDA is needed
        chosen = select_gdn_kernel("auto", device, torch.bfloat16, 128, 128, kernels)
        assert chosen.name == "torch"
        with pytest.raises(GdnKernelError, match=r"pip install 'usp\[fla\]'"):
            select_gdn_kernel("fla", device, torch.bfloat16, 128, 128, kernels)
    assert select_gdn_kernel("torch", CPU, torch.float64, 8, 6, kernels).name == "torch"
    with pytest.raises(
        GdnKernelError, match="unknown GDN kernel 'triton'; valid: auto, torch, fla"
    ):
        select_gdn_kernel("triton", CPU, torch.float32, 8, 6, kernels)


def test_present_fla_is_not_taken_off_cuda_nor_for_what_it_does_not_run():
    fla = FlaGdnKernel(FlaStandIn())  # installed, CUDA only (fla's own limits)
    kernels = _kernels(fla)
    assert select_gdn_kernel("auto", CPU, torch.bfloat16, 64, 64, kernels).name == "torch"
    with pytest.raises(GdnKernelError, match="runs on cuda, not cpu"):
        select_gdn_kernel("fla", CPU, torch.bfloat16, 64, 64, kernels)
    for dtype, dk, why in [
        (torch.float64, 64, "not torch.float64"),
        (torch.bfloat16, 512, "up to 256"),
    ]:
        assert select_gdn_kernel("auto", CUDA, dtype, dk, 64, kernels).name == "torch"
        with pytest.raises(GdnKernelError, match=why):
            select_gdn_kernel("fla", CUDA, dtype, dk, 64, kernels)
    assert fla._function.calls == []  # no self-check ran: nothing was eligible


def test_a_correct_stand_in_passes_its_self_check_once():
    fla = standin_kernel(float64=False)
    kernels = _kernels(fla)
    assert select_gdn_kernel("auto", CPU, torch.float32, 16, 24, kernels) is fla
    with torch.no_grad():  # a first call in evaluation: the check still differentiates
        assert select_gdn_kernel("auto", CPU, torch.bfloat16, 16, 24, kernels) is fla
    calls = len(fla._function.calls)
    assert calls == 2  # one checked call (forward, then its backward) per dtype
    assert select_gdn_kernel("fla", CPU, torch.float32, 16, 24, kernels) is fla
    assert len(fla._function.calls) == calls  # the verdict is cached per (device, dtype, dk, dv)


@pytest.mark.parametrize("defect", DEFECTS)
def test_the_self_check_refuses_a_kernel_that_is_wrong(defect):
    kernels = _kernels(standin_kernel(defect, float64=False))
    with pytest.raises(GdnKernelError, match="failed its self-check on cpu, torch.float32"):
        select_gdn_kernel("fla", CPU, torch.float32, 16, 24, kernels)
    with pytest.warns(RuntimeWarning, match="GDN kernel 'fla' skipped by auto: it failed its"):
        chosen = select_gdn_kernel("auto", CPU, torch.bfloat16, 16, 24, kernels)
    assert chosen.name == "torch"


def _padded_rows(lengths, heads, dk, dv, seed):
    """Padded rows as gdn.py hands them to the kernel (zeros past each row's length)."""
    gen = torch.Generator().manual_seed(seed)
    n, length = len(lengths), max(lengths)
    valid = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).double()

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = (torch.nn.functional.normalize(randn(n, length, heads, dk), dim=-1) for _ in "qk")
    q = q * 0.7
    v = randn(n, length, heads, dv)
    g = -torch.rand(n, length, heads, generator=gen, dtype=torch.float64)
    beta = torch.rand(n, length, heads, generator=gen, dtype=torch.float64)
    tensors = [t * valid[:, :, None, None] for t in (q, k, v)] + [
        t * valid[..., None] for t in (g, beta)
    ]
    return tensors, randn(n, heads, dk, dv) * 0.5, valid


def test_the_mapping_onto_fla_arguments_against_the_torch_kernel():
    """Rows of unequal lengths (one empty) with initial states, float64: the stand-in
    path equals the torch kernel forward and backward; what fla receives is checked."""
    lengths = [9, 0, 14, 3]
    inputs, state, valid = _padded_rows(lengths, 2, 8, 6, seed=0)
    dout = torch.randn(*inputs[2].shape, dtype=torch.float64) * valid[:, :, None, None]
    dstate = torch.randn(state.shape, dtype=torch.float64)
    results = []
    fla = standin_kernel()
    for kernel in (TorchGdnKernel(), fla):
        leaves = [t.clone().requires_grad_() for t in (*inputs, state)]
        o, final = kernel.run(
            *leaves[:5], lengths=lengths, initial_state=leaves[5], chunk_size=5,
            io_dtype=torch.float64,
        )  # fmt: skip
        grads = torch.autograd.grad((o, final), leaves, (dout, dstate))
        per_token = [o, *grads[:5]]  # the decay's gradient past a row's end is not used
        keep = valid.bool()
        results.append([t[keep] for t in per_token] + [final, grads[5]])
    for name, a, e in zip(["o", "dq", "dk", "dv", "dg", "dbeta", "final", "dstate"], *results):
        assert relative_error(a, e) < 1e-12, name
    (call,) = fla._function.calls
    assert call["cu_seqlens"].tolist() == [0, 9, 23, 26]  # the empty row is left out
    assert call["cu_seqlens_cpu"].tolist() == [0, 9, 23, 26]
    assert call["q"].shape == (1, 26, 2, 8) and call["v"].shape == (1, 26, 2, 6)
    assert call["initial_state"].shape == (3, 2, 8, 6)
    assert torch.equal(call["initial_state"], state[[0, 2, 3]])
    assert call["scale"] == 1.0 and call["chunk_size"] == 64  # q comes scaled; 5 -> 64
    assert call["output_final_state"] is True
    assert torch.equal(call["k"][0, 9:23], inputs[1][2, :14])  # row 2's tokens, in order
    empty = [t[:, :0] for t in inputs]  # no token in any row: fla is not called
    o, final = fla.run(
        *empty, lengths=[0] * 4, initial_state=state, chunk_size=64, io_dtype=torch.float64
    )
    assert o.shape == (4, 0, 2, 6) and torch.equal(final, state) and len(fla._function.calls) == 1


def test_bfloat16_activations_reach_fla_as_bfloat16_with_a_float32_decay():
    lengths = [16, 16]  # full rows: no packing copy, no initial state
    inputs, _, _ = _padded_rows(lengths, 2, 8, 8, seed=1)
    fla = standin_kernel()
    low = [t.float() for t in inputs]
    o, final = fla.run(
        *low, lengths=lengths, initial_state=None, chunk_size=32, io_dtype=torch.bfloat16
    )
    (call,) = fla._function.calls
    assert [call[n].dtype for n in ("q", "k", "v", "beta")] == [torch.bfloat16] * 4
    assert call["g"].dtype == torch.float32 and call["initial_state"] is None
    assert call["chunk_size"] == 32
    assert o.dtype == torch.float32 and final.dtype == torch.float32  # the seam's dtype
    ref, ref_final = TorchGdnKernel().run(
        *inputs, lengths=lengths, initial_state=None, chunk_size=32, io_dtype=torch.float64
    )
    assert relative_error(o.double(), ref) < 2e-2
    assert relative_error(final.double(), ref_final) < 2e-2


def test_gated_deltanet_usp_runs_the_chosen_kernel_in_one_process():
    inputs, ws, _ = gdn_inputs(1, 23, 2, 4, 8, 6, 4, seed=5)
    cu = torch.tensor([0, 1, 3, 12, 23], dtype=torch.int32)
    fla = standin_kernel()
    out = gated_deltanet_usp(
        *inputs, None, conv_weights=ws, packed=cu, chunk_size=16, kernel="fla",
        kernels=_kernels(fla),
    )  # fmt: skip
    assert relative_error(out, reference_gdn(*inputs, ws, cu)) < 1e-12
    assert fla._function.calls[-1]["cu_seqlens"].tolist() == [0, 1, 3, 12, 23]
    with pytest.raises(GdnKernelError, match="unknown GDN kernel 'fast'"):
        gated_deltanet_usp(*inputs, None, kernel="fast")


def test_the_module_passes_its_kernel_choice_on():
    layer = GatedDeltaNet(16, 2, 4, 8, 6, kernel="fla").double()  # fla cannot run on the CPU
    with pytest.raises(GdnKernelError, match="GDN kernel 'fla' cannot run this call"):
        layer(torch.randn(1, 12, 16, dtype=torch.float64))
    layer.kernel = "torch"
    assert layer(torch.randn(1, 12, 16, dtype=torch.float64)).shape == (1, 12, 16)


# ------------------------------------------------------------------ the short conv
def _convs(fast):
    return {"torch": TorchConvKernel(), "causal_conv1d": fast}


def test_conv_choice_absent_off_cuda_and_out_of_limits():
    absent = _convs(CausalConv1dKernel(module="usp_test_no_such_package"))
    assert select_conv_kernel("auto", CUDA, torch.bfloat16, 64, 4, absent).name == "torch"
    with pytest.raises(ConvKernelError, match=r"pip install 'usp\[fla\]'"):
        select_conv_kernel("causal_conv1d", CUDA, torch.bfloat16, 64, 4, absent)
    present = CausalConv1dKernel(CausalConv1dStandIn())  # CUDA only, as the package
    kernels = _convs(present)
    assert select_conv_kernel("auto", CPU, torch.float32, 64, 4, kernels).name == "torch"
    with pytest.raises(ConvKernelError, match="runs on cuda, not cpu"):
        select_conv_kernel("causal_conv1d", CPU, torch.float32, 64, 4, kernels)
    for channels, width, why in [(64, 5, "sizes 2 to 4, not 5"), (60, 4, "multiples of 8")]:
        assert (
            select_conv_kernel("auto", CUDA, torch.bfloat16, channels, width, kernels).name
            == "torch"
        )
        with pytest.raises(ConvKernelError, match=why):
            select_conv_kernel("causal_conv1d", CUDA, torch.bfloat16, channels, width, kernels)
    assert present._function.calls == []
    with pytest.raises(ConvKernelError, match="unknown conv kernel 'cudnn'"):
        select_conv_kernel("cudnn", CPU, torch.float32, 64, 4, kernels)


def test_conv_self_check_passes_a_correct_stand_in_and_refuses_wrong_ones():
    good = standin_conv_kernel()
    for dtype in (torch.float32, torch.bfloat16):
        assert select_conv_kernel("auto", CPU, dtype, 64, 4, _convs(good)) is good
    calls = len(good._function.calls)
    assert calls == 4  # per dtype: activation silu and None
    assert select_conv_kernel("causal_conv1d", CPU, torch.float32, 64, 4, _convs(good)) is good
    assert len(good._function.calls) == calls  # cached per (device, dtype, K)
    for defect in CONV_DEFECTS:
        kernels = _convs(standin_conv_kernel(defect))
        with pytest.raises(ConvKernelError, match="failed its self-check on cpu"):
            select_conv_kernel("causal_conv1d", CPU, torch.float32, 64, 3, kernels)
        with pytest.warns(RuntimeWarning, match="'causal_conv1d' skipped by auto"):
            assert select_conv_kernel("auto", CPU, torch.float16, 64, 3, kernels).name == "torch"


def test_gated_deltanet_usp_runs_the_conv_through_causal_conv1d():
    inputs, ws, dout = gdn_inputs(1, 23, 2, 4, 8, 6, 4, seed=6)  # 2*2*8 + 4*6 = 56 channels
    cu = torch.tensor([0, 5, 23], dtype=torch.int32)
    conv = standin_conv_kernel()
    leaves = [t.clone().requires_grad_() for t in (*inputs, *ws)]
    out = gated_deltanet_usp(
        *leaves[:5], None, conv_weights=leaves[5:], packed=cu, conv_kernel="causal_conv1d",
        conv_kernels=_convs(conv),
    )  # fmt: skip
    ref_leaves = [t.clone().requires_grad_() for t in (*inputs, *ws)]
    ref = reference_gdn(*ref_leaves[:5], ref_leaves[5:], cu)
    assert relative_error(out, ref) < 1e-12
    grads = torch.autograd.grad(out, leaves, dout)
    for grad, want in zip(grads, torch.autograd.grad(ref, ref_leaves, dout)):
        assert relative_error(grad, want) < 1e-11
    call = conv._function.calls[-1]
    assert call["x"].shape == (2, 56, 18) and call["x"].stride(1) == 1  # 2 documents, channel-last
    assert call["initial_states"].shape == (2, 56, 3) and call["activation"] == "silu"
    layer = GatedDeltaNet(16, 2, 4, 8, 6, conv_kernel="causal_conv1d").double()
    with pytest.raises(ConvKernelError, match="conv kernel 'causal_conv1d' cannot run this call"):
        layer(torch.randn(1, 12, 16, dtype=torch.float64))


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_the_torch_kernel_under_strong_decay_in_float32(chunk_size):
    """A chunk whose decay sums far past float32's exp range (6-12 nats a token: hundreds
    of nats in a chunk; exp overflows beyond ~88): the chunked kernel's forward and every
    gradient stay finite and equal the float64 token-by-token recurrence, packed
    documents and an initial state included (a kernel that exponentiated the decay
    differences before masking the upper triangle would give NaN gradients here)."""
    from usp.linear.kernel import chunk_gated_delta_rule, recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(7)
    seq, hk, heads, dk, dv = 80, 1, 2, 8, 6
    q, k = (torch.randn(1, seq, hk, dk, generator=gen, dtype=torch.float64) for _ in "qk")
    v = torch.randn(1, seq, heads, dv, generator=gen, dtype=torch.float64)
    g = -6 - 6 * torch.rand(1, seq, heads, generator=gen, dtype=torch.float64)
    g[:, ::7] = -0.05  # a few mild steps, so that the state carries something
    beta = torch.rand(1, seq, heads, generator=gen, dtype=torch.float64)
    h0 = torch.randn(2, heads, dk, dv, generator=gen, dtype=torch.float64)
    dout = torch.randn(1, seq, heads, dv, generator=gen, dtype=torch.float64)
    bounds = [0, 37, seq]
    inputs = [q, k, v, g, beta, h0]

    ref = [t.clone().requires_grad_() for t in inputs]
    outs = [
        recurrent_gated_delta_rule(*(t[:, a:b] for t in ref[:5]), initial_state=ref[5][i : i + 1],
                                   use_qk_l2norm=True)[0]
        for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
    ]  # fmt: skip
    expected = torch.cat(outs, dim=1)
    expected_grads = torch.autograd.grad(expected, ref, dout)

    ours = [t.float().requires_grad_() for t in inputs]
    out, _ = chunk_gated_delta_rule(*ours[:5], initial_state=ours[5], cu_seqlens=bounds,
                                    use_qk_l2norm=True, chunk_size=chunk_size)  # fmt: skip
    grads = torch.autograd.grad(out, ours, dout.float())
    assert relative_error(out.double(), expected) < 1e-5
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, expected_grads):
        assert torch.isfinite(got).all(), name
        assert relative_error(got.double(), want) < 1e-4, name
