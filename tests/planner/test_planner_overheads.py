"""What ``usp plan`` adds to the measured step (:mod:`usp.planner.overheads`): the kernel
workspaces against the real CPU kernel's allocations and inside the measured step, the
communicators per layout, the budget's arithmetic, the pinned rounding, the parameter
offload's host accounting, the budget as the sum of the printed lines, and the
allocator setting ``usp train`` uses."""

from __future__ import annotations

import re

import pytest
import torch
from planner_cases import target_of, write_config
from torch.profiler import ProfilerActivity, profile

from usp.config import allocator
from usp.models import Levers
from usp.models.offload import pinned_bytes
from usp.planner import kernels, overheads, report, search
from usp.planner.footprint import Choice, Extras, Footprint, Phase
from usp.planner.measure import measure
from usp.planner.overheads import GIB, attention_workspace, communicators

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


# ----------------------------------------------------------------------------- workspaces
def _extra_allocation(fn) -> int:
    """Bytes ``fn`` held at its peak beyond the tensors it returns (torch.profiler's
    allocator events: what the kernel allocated for itself)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    running = peak = 0
    for e in events:
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
            running += e.nbytes()
            peak = max(peak, running)
    return peak - sum(t.numel() * t.element_size() for t in out)


CPU_SHAPES = [
    (64, 4, 4, 32),
    (1024, 4, 2, 64),
    (300, 2, 2, 128),
    (2048, 2, 1, 128),
    (100, 2, 1, 16),
]


def _cpu_kernel_extras(seqlen, heads, kv_heads, dim, dtype) -> tuple[int, int, int]:
    """The real CPU flash kernel's own allocations, forward and backward, in usp's layout
    (BSHD memory seen as BHSD), and its inputs' item size."""
    gen = torch.Generator().manual_seed(seqlen)

    def bshd(h):
        return torch.randn(1, seqlen, h, dim, generator=gen).to(dtype).transpose(1, 2)

    q, k, v, dout = bshd(heads), bshd(kv_heads), bshd(kv_heads), bshd(heads)
    forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    out, lse = forward_op(q, k, v, 0.0, True, scale=0.1)
    forward = _extra_allocation(lambda: forward_op(q, k, v, 0.0, True, scale=0.1))
    backward = _extra_allocation(lambda: backward_op(dout, q, k, v, out, lse, 0.0, True, scale=0.1))
    return forward, backward, q.element_size()


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_workspace_is_what_the_real_kernel_allocates(dtype, threads, onednn):
    """The CPU flash kernel on this machine's instruction set: a forward takes one of its
    two paths (packed K/V where oneDNN packs the dtype, AMX; plain elsewhere) and
    allocates exactly that path's formula; the planned forward is that path's, or the
    packed one where which path runs is not certain (never below); a reduced-precision
    backward within its GEMM packing allowance. oneDNN off (``torch.backends.mkldnn``,
    the switch torch gives) forces the plain path on any CPU."""
    torch.set_num_threads(threads)
    try:
        with torch.backends.mkldnn.flags(enabled=onednn):
            packing = kernels.cpu_packing(dtype)
            for seqlen, heads, kv_heads, dim in CPU_SHAPES:
                forward, backward, item = _cpu_kernel_extras(seqlen, heads, kv_heads, dim, dtype)
                shape = dict(batch=1, seqlen_q=seqlen, seqlen_k=seqlen, heads=heads,
                             kv_heads=kv_heads, head_dim=dim, item_bytes=item,
                             threads=threads)  # fmt: skip
                plain = attention_workspace("cpu", backward=False, **shape)
                planned = attention_workspace("cpu", backward=False, cpu_packing=packing, **shape)
                assert forward in (plain, planned), (shape, forward, plain, planned)
                assert planned >= forward, shape
                if packing is None or dtype == torch.bfloat16:  # the path is certain
                    assert planned == forward, shape
                planned = attention_workspace("cpu", backward=True, cpu_packing=packing, **shape)
                if dtype == torch.float32:
                    assert planned == backward, shape
                else:
                    assert 0 <= planned - backward <= threads * overheads.CPU_GEMM_PACKING, shape
    finally:
        torch.set_num_threads(1)


def test_cpu_packed_forward_is_the_kernels_packed_buffers(monkeypatch):
    """The packed path (not runnable on a CPU without AMX): on a Sapphire Rapids Xeon
    (AMX-BF16, AVX512-FP16) torch 2.13's bf16 forward of 64 tokens, 4 heads of 32 was
    measured at 53,504 bytes (issue 63), 16,640 of them the plain path's buffers and the
    rest K and V packed [1, 4, 32, 64] + [1, 4, 64, 32] and a transpose buffer [64, 32];
    the thresholds decide per call; which CPUs pack is read from torch's CPU capability
    and oneDNN's switch."""
    bf16 = overheads.CPU_PACKING["bfloat16"]
    shape = dict(batch=1, seqlen_q=64, seqlen_k=64, heads=4, kv_heads=4, head_dim=32,
                 item_bytes=2, threads=1, backward=False)  # fmt: skip
    assert attention_workspace("cpu", **shape) == 16_640
    assert attention_workspace("cpu", cpu_packing=bf16, **shape) == 53_504
    short = dict(shape, seqlen_q=63, seqlen_k=63)  # below bf16's 64 tokens: not packed
    assert attention_workspace("cpu", cpu_packing=bf16, **short) == attention_workspace(
        "cpu", **short
    )
    # odd head dim and odd key count: K, V and the query block padded to even sizes
    odd = dict(shape, seqlen_q=65, seqlen_k=65, head_dim=33)
    plain = attention_workspace("cpu", **odd)
    extra = 2 * (4 * 34 * 65 + 4 * 66 * 33 + 65 * 33 + 32 * 34) + 32 * 1 * 2  # + even reduced
    assert attention_workspace("cpu", cpu_packing=bf16, **odd) == plain + extra
    # the per-thread GEMM work must reach 4x the packed size (bf16): 16 heads of 64 tokens
    # over 64 threads (one query block of 32 each, against 16 heads of K) do not
    thin = dict(shape, heads=16, kv_heads=16, threads=64)
    assert attention_workspace("cpu", cpu_packing=bf16, **thin) == attention_workspace(
        "cpu", **thin
    )

    amx = {"amx_bf16": True, "amx_fp16": False, "avx512_fp16": True}
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: amx)
    assert kernels.cpu_packing(torch.bfloat16) == bf16
    assert kernels.cpu_packing(torch.float16) == overheads.CPU_PACKING["float16"]
    assert kernels.cpu_packing(torch.float32) is None
    with torch.backends.mkldnn.flags(enabled=False):
        assert kernels.cpu_packing(torch.bfloat16) is None
    monkeypatch.setattr(torch._C._cpu, "_get_cpu_capability", lambda: {"avx2": True})
    assert kernels.cpu_packing(torch.bfloat16) is None


def test_cuda_workspaces_are_the_documented_shapes():
    """FA2's backward (PyTorch's flash_api.cpp): float32 dq_accum [B, Sq+128, H, D to 32]
    and softmax_d [B, H, Sq+128], with GQA the H-head dK and dV in the input dtype;
    cuDNN's: float32 dQ_accum [B, H, Sq, D] and softmax_sum [B, H, Sq]; no forward
    workspace for either."""
    shape = dict(batch=2, seqlen_q=1000, seqlen_k=3000, heads=32, kv_heads=8, head_dim=120,
                 item_bytes=2)  # fmt: skip
    flash = 4 * 2 * 1128 * 32 * 128 + 4 * 2 * 32 * 1128 + 2 * 2 * 3000 * 32 * 120 * 2
    assert attention_workspace("flash", backward=True, **shape) == flash
    assert attention_workspace("flash_attn", backward=True, **shape) == flash
    mha = dict(shape, kv_heads=32)
    assert attention_workspace("flash", backward=True, **mha) == flash - 2 * 2 * 3000 * 32 * 120 * 2
    assert attention_workspace("cudnn", backward=True, **shape) == 4 * 2 * 32 * 1000 * (120 + 1)
    for backend in ("flash", "cudnn"):
        assert attention_workspace(backend, backward=False, **shape) == 0
    assert attention_workspace("efficient", backward=False, **shape) == 2 * 2 * 3000 * 32 * 120 * 2
    assert attention_workspace("math", backward=True, **shape) == 0


def test_the_workspace_counts_inside_the_measured_step(tmp_path, monkeypatch):
    """A CUDA plan (auto: FA2 for the packed calls): with the workspaces the backward
    peak is higher than without by at most the largest one, which the log names."""
    from usp.planner import kernels

    target = target_of(write_config(tmp_path, layers=2, seq_len=2048), 4, device="cuda")
    choice = Choice(1, 4, 1, Levers(True))
    with_workspace = measure(target, choice)
    monkeypatch.setattr(kernels, "attention_workspace", lambda *a, **k: 0)
    without = measure(target, choice)
    extras = with_workspace.extras
    assert extras.workspace > 0 and extras.workspace_call.startswith("flash backward")
    assert without.extras.workspace == 0
    grown = with_workspace.phases[1].device - without.phases[1].device  # backward 0
    assert 0 < grown <= extras.workspace, (grown, extras.workspace)
    assert [p.device for p in with_workspace.phases[:1]] == [p.device for p in without.phases[:1]]


# ----------------------------------------------------------------------------- NCCL
def _kinds(choice, per_node=8, nvswitch=True):
    return {c.group: (c.size, c.kinds) for c in communicators(*choice, ranks_per_node=per_node,
                                                              nvswitch=nvswitch)}  # fmt: skip


def test_communicators_per_layout():
    ring_world = _kinds((1, 8, 1))
    assert ring_world == {"world": (8, ("collective", "nvls", "peer", "peer"))}
    assert _kinds((8, 1, 1)) == {"world": (8, ("collective", "nvls") + ("peer",) * 7)}
    assert _kinds((2, 4, 1)) == {
        "world": (8, ("collective", "nvls")),
        "ring": (4, ("collective", "peer", "peer")),
        "ulysses": (2, ("collective", "peer")),
    }
    assert _kinds((2, 2, 2))["sp"] == (4, ("collective",)) and _kinds((2, 2, 2))["dp"][0] == 2
    assert _kinds((1, 2, 1)) == {"world": (2, ("collective", "nvls", "peer"))}
    assert _kinds((1, 8, 1), nvswitch=False)["world"][1] == ("collective", "peer", "peer")
    assert _kinds((1, 1, 1)) == {"world": (1, ("single",))}
    total = sum(c.nbytes for c in communicators(8, 8, 1, ranks_per_node=8, nvswitch=True))
    assert total == pytest.approx((3 * 1.0 + 2.25 + 9 * 0.47) * GIB, abs=4)


# ----------------------------------------------------------------------------- budget
def _h100(choice, **cluster):
    target = target_of_cuda()
    values = dict(nodes=1, gpus_per_node=8, gpu_memory_gib=79.6, host_memory_gib=2048.0,
                  gpu="H100") | cluster  # fmt: skip
    return target, search.overheads(target, choice, search.Cluster(**values))


def target_of_cuda():
    import tempfile
    from pathlib import Path

    return target_of(write_config(Path(tempfile.mkdtemp()), gpus=8), 8, device="cuda")


def test_the_budget_adds_every_item_and_judges_at_its_edge():
    choice = Choice(1, 8, 1, Levers(True))
    _, costs = _h100(choice)
    names = [i.name for i in costs.device_fixed]
    assert names == ["NCCL communicators", "CUDA context and libraries", "margin"]
    budget = costs.budget()
    fixed = int((1.0 + 2.25 + 2 * 0.47) * GIB) + int(1.0 * GIB) + int(0.01 * 79.6 * GIB)
    assert budget.device_fixed == fixed and budget.reserve_fraction == 0.05
    limit = budget.device_peak_limit
    assert limit == pytest.approx((79.6 * GIB - fixed) / 1.05)

    def footprint(device, host=0):
        return Footprint((Phase(int(device), int(host)),), layers=1)

    assert search.judge(footprint(limit), costs)[0]
    fits, why = search.judge(footprint(limit + 1), costs)
    assert not fits and "device" in why and "overheads" in why
    host_limit = (2048 * GIB - 0.05 * 2048 * GIB) / 8 - 4 * GIB
    assert budget.host_peak_limit == pytest.approx(host_limit)
    assert search.judge(footprint(0, host_limit), costs)[0]
    assert not search.judge(footprint(0, host_limit + 8), costs)[0]
    # the flat 90% of before was more optimistic than these items on an H100
    assert limit < 0.9 * 79.6 * GIB


_ROW = re.compile(r"^  (\+ |  )?(\S.*?)\s+(\d+\.\d+) GiB  (\S+)")
_TOTALS = re.compile(r"^  = device (\d+\.\d) of .* GiB; host (\d+\.\d) of ")


def _assert_budget_is_the_sum_of_the_printed_lines(candidate, cluster) -> set[str]:
    """The totals the planner judges by (device and host) are the sums of the lines
    ``usp plan`` prints ("+" lines added, unmarked ones shown only): exactly from the
    items, and to the printed rounding from the printed text. Returns the printed names."""
    costs, footprint = candidate.overheads, candidate.footprint
    budget = costs.budget(footprint.extras)
    items = costs.items(footprint.peak_device, footprint.extras)
    added = {w: sum(i.nbytes for i in items if i.where == w and i.added) for w in WHERE}
    device = footprint.peak_device + added["device"]
    assert abs(budget.device_total(footprint.peak_device) - device) <= 1  # int() of the reserve
    host = cluster.gpus_per_node * (footprint.peak_host + added["host"]) + added["node"]
    assert budget.host_total(footprint.host_total) == host
    lines = report.overhead_lines(candidate, cluster)
    rows = [_ROW.match(line).groups() for line in lines[:-1]]
    assert len(rows) == len(items) + 1  # the measured step, then one line per item
    printed = {w: sum(float(g) for mark, _, g, w2 in rows if mark != "  " and w2 == w)
               for w in WHERE.values()}  # fmt: skip
    shown_device, shown_host = map(float, _TOTALS.match(lines[-1]).groups())
    tolerance = 0.005 * len(rows) + 0.05  # each line rounded to 0.01, the total to 0.1
    assert abs(printed["device"] - shown_device) <= tolerance, lines
    printed_host = (
        cluster.gpus_per_node * (footprint.peak_host / GIB + printed["host/rank"])
        + printed["host/node"]
    )
    assert abs(printed_host - shown_host) <= cluster.gpus_per_node * tolerance, lines
    assert abs(shown_device - device / GIB) <= 0.05 and abs(shown_host - host / GIB) <= 0.05
    return {(mark or "") + name for mark, name, _, _ in rows}


WHERE = {"device": "device", "host": "host/rank", "node": "host/node"}


def test_the_budget_is_the_sum_of_the_printed_lines():
    """Every line the report prints with "+" is in the budget the planner judges by:
    a footprint with a workspace (shown, inside the step), parameter offload copies
    (device, added) and pinned rounding (host, added), on an H100 node of 8."""
    choice = Choice(2, 2, 2, Levers(True, offload_optimizer=True, offload_parameters=True))
    _, costs = _h100(choice)
    cluster = search.Cluster(1, 8, 79.6, 2048.0, gpu="H100")
    extras = Extras(workspace=3 * GIB // 7, workspace_call="q [1, 4096, 8, 128]",
                    pinned=GIB // 3, offload_copies=5 * GIB // 4)  # fmt: skip
    footprint = Footprint((Phase(40 * GIB, 0), Phase(30 * GIB, 6 * GIB)), 1, extras=extras)
    candidate = search.Candidate(choice, 4096, footprint, True, None, 1.0, overheads=costs)
    names = _assert_budget_is_the_sum_of_the_printed_lines(candidate, cluster)
    assert {
        "+ parameter offload copies", "+ pinned rounding", "  attention kernel workspace"
    } <= names, names  # fmt: skip
    fits, _ = search.judge(footprint, costs)
    limit = costs.budget(extras).device_peak_limit
    assert fits and limit < (79.6 * GIB - 5 * GIB // 4)  # the copies lower the limit


def test_a_cpu_rank_pays_only_the_margin(tmp_path):
    target = target_of(write_config(tmp_path, gpus=2), 2)
    costs = search.overheads(target, Choice(1, 2, 1), search.Cluster(1, 2, 1.0, 2.0))
    assert [i.name for i in costs.items(0)] == ["margin"]
    assert costs.budget().device_peak_limit == GIB - int(0.01 * GIB)


def test_pinned_blocks_round_up_to_powers_of_two():
    assert [pinned_bytes(n) for n in (0, 1, 4096, 4097, 3 * 2**30)] == [0, 1, 4096, 8192, 2**32]


def test_offloaded_layer_inputs_pay_the_pinned_rounding(tmp_path):
    layers, seq_len, world = 3, 1536, 4  # 384 tokens x hidden 64 x bf16 per layer: not 2^k
    target = target_of(write_config(tmp_path, layers=layers, seq_len=seq_len), world, "cuda")
    footprint = measure(target, Choice(2, 2, 1, Levers("offload")))
    block = seq_len // world * target.model.hidden_size * 2
    assert footprint.extras.pinned == layers * (pinned_bytes(block) - block) > 0
    assert footprint.host_total == footprint.peak_host + footprint.extras.pinned


def test_parameter_offload_moves_the_training_state_to_the_host(tmp_path):
    """A CUDA plan on the CPU stand-in: with offload_optimizer AdamW's moments leave the
    device (its optimizer phase) for the host; with offload_parameters the parameter and
    gradient shards too, and the device pays FSDP's copies instead (an MLP of 96: shards
    that are not powers of two, so pinning them costs a rounding)."""
    path = write_config(tmp_path, layers=3, seq_len=1024, extra_model="intermediate_size = 96")
    target = target_of(path, 4, device="cuda")
    plain = measure(target, Choice(2, 2, 1, Levers(True)))
    optimizer = measure(target, Choice(2, 2, 1, Levers(True, offload_optimizer=True)))
    both = measure(
        target, Choice(2, 2, 1, Levers(True, offload_optimizer=True, offload_parameters=True))
    )
    # the moments and step counts as the first step left them (held through clipping; the
    # optimizer phase adds the foreach update's temporaries, filed under the state too)
    state = plain.phases[-2].breakdown["optimizer_state"]
    assert state > 0 and plain.peak_host == 0
    assert plain.phases[-1].breakdown["optimizer_state"] > state
    assert optimizer.phases[-1].breakdown["optimizer_state"] < state / 100
    assert optimizer.peak_host >= state  # the moments (and a shard's copies) on the host
    shards = plain.phases[-1].breakdown["parameters"]
    assert "parameters" not in both.phases[-1].breakdown
    assert both.peak_host >= state + shards
    assert both.phases[-1].device < optimizer.phases[-1].device
    assert both.extras.offload_copies > 0 and optimizer.extras.offload_copies == 0
    assert both.extras.pinned > 0  # FSDP pins each shard and gradient on CUDA
    choice = Choice(2, 2, 1, Levers(True, offload_optimizer=True, offload_parameters=True))
    cluster = search.Cluster(1, 4, 79.6, 2048.0, gpu="H100")
    costs = search.overheads(target, choice, cluster)
    candidate = search.Candidate(choice, 1024, both, True, None, 1.0, overheads=costs)
    names = _assert_budget_is_the_sum_of_the_printed_lines(candidate, cluster)
    assert "+ parameter offload copies" in names, names


# ----------------------------------------------------------------------------- allocator
def test_usp_train_turns_expandable_segments_on_unless_the_user_decided():
    assert allocator.allocator_settings({}) == "expandable_segments:True"
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert allocator.set_allocator_default(env) == "max_split_size_mb:512,expandable_segments:True"
    assert env["PYTORCH_CUDA_ALLOC_CONF"].endswith("expandable_segments:True")
    off = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert allocator.allocator_settings(off) == "expandable_segments:False"
    assert allocator.expandable_segments({}) and not allocator.expandable_segments(off)
    # the planner follows the same rule for its allocator reserve
    common = dict(device="cuda", gpu="H100", gpu_memory_gib=79.6, host_memory_gib=2048.0,
                  ranks_per_node=8, ulysses=1, ring=8, dp=1, nvswitch=True)  # fmt: skip
    on = overheads.overheads_for(**common, environ={})
    fixed_segments = overheads.overheads_for(**common, environ=off)
    assert (on.reserve_setting, on.reserve_fraction) == ("expandable_segments", 0.05)
    assert (fixed_segments.reserve_setting, fixed_segments.reserve_fraction) == (
        "fixed_segments", 0.15,
    )  # fmt: skip


# ----------------------------------------------------------------------------- the GPU check
def test_overheads_check_compares_each_item_and_fails_where_the_planner_is_optimistic(
    tmp_path, monkeypatch, capsys
):
    """benchmarks/overheads_check.py (gpu_check.sh's overheads step) on the CPU: the real
    kernel within the planner's figure passes; a planner that counted less fails with
    the constant to raise."""
    import json

    from usp_cases import load_benchmark

    script = load_benchmark("overheads_check")
    assert script.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "overheads_check.json").read_text())
    assert rows and all(r["ok"] and r["measured"] > 0 for r in rows)
    monkeypatch.setattr(overheads, "attention_workspace", lambda *a, **k: 1024)
    assert script.main(["--device", "cpu"]) == 1
    assert "FAILED: raise attention_workspace" in capsys.readouterr().out


def test_host_adam_benchmark_runs():
    from usp_cases import load_benchmark

    row = load_benchmark("host_adam").main(
        ["--params", "20000", "--tensors", "2", "--repeats", "1"]
    )
    assert row["params"] == 20000 and row["params_per_s"] > 0
