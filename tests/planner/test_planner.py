"""``usp plan``: one rank's step measured under fake tensors, scaled by depth, held
against a real step, searched and printed."""

import json
import math

import pytest
import torch
from planner_cases import target_of, write_config

import usp.planner.measure as measure_module
from usp.cli import main
from usp.models import Levers
from usp.planner.footprint import Choice
from usp.planner.measure import measure, measure_scaled
from usp.planner.traffic import fsdp_traffic
from usp.planner.validate import real_peak
from usp.train.config import load_train_config

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


# ----------------------------------------------------------------------------- depth
@pytest.mark.parametrize(
    "choice, checkpointing",
    [(Choice(2, 2, 1, Levers(True)), True), (Choice(1, 2, 2, Levers(False)), False)],
)
def test_scaled_depth_equals_a_full_depth_run(tmp_path, monkeypatch, choice, checkpointing):
    """Measured at 3 and 4 layers and extrapolated to 6, every phase's peak (and each
    part of its breakdown) equals a 6-layer run byte for byte. (The 3-layer run that
    ``measure_scaled`` makes is read back through a recording ``measure``, not run again.)"""
    path = write_config(tmp_path, layers=6, seq_len=256, global_batch=2, layout="contiguous")
    target = target_of(path, 4)
    full = measure(target, choice)
    runs = {}

    def recorded(target_, choice_, *, layers=None, **kwargs):
        runs[layers] = measure(target_, choice_, layers=layers, **kwargs)
        return runs[layers]

    monkeypatch.setattr(measure_module, "measure", recorded)
    scaled = measure_scaled(target, choice)
    assert sorted(runs) == [3, 4]  # (the two shallow runs, nothing else)
    assert full.layers == scaled.layers == 6
    assert [p.device for p in scaled.phases] == [p.device for p in full.phases]
    assert [p.breakdown for p in scaled.phases] == [p.breakdown for p in full.phases]
    assert scaled.peak_device == full.peak_device > 0
    # what the extrapolation must get right: deeper is more memory, also in backward
    assert full.peak_device > runs[3].peak_device and runs[3].layers == 3


# ----------------------------------------------------------------------------- real step
@pytest.mark.parametrize(
    "choice, ring_impl",
    [(Choice(2, 2, 1, Levers(True)), "p2p"), (Choice(1, 4, 1, Levers(False)), "allgather")],
)
def test_estimate_matches_what_a_real_cpu_step_allocates(tmp_path, choice, ring_impl):
    """The same step run for real, its peak from torch.profiler's allocator events (not
    the tracker): the fake-tensor estimate is within 10% (measured: 0.995 and 0.998)."""
    path = write_config(tmp_path, seq_len=4096, ring_impl=ring_impl)
    target = target_of(path, 4)
    estimate = measure(target, choice).peak_device
    real = real_peak(target, choice)
    assert real > 1_000_000  # a real step of 1024 tokens per rank, not an empty profile
    assert 0.9 <= estimate / real <= 1.1, (estimate, real)


# ----------------------------------------------------------------------------- offload
def test_offloaded_layer_inputs_count_as_host_memory_not_device(tmp_path):
    """A CUDA plan (bf16) with ``activation_checkpointing = "offload"`` against on-device
    checkpointing: the forward's device peak drops by exactly the layer inputs (layers x
    local tokens x hidden x 2 bytes), which show as the host peak; in backward one layer's
    input is back on the device for its recompute, so that peak drops by whole layers."""
    layers, seq_len, world = 3, 1024, 4
    path = write_config(tmp_path, layers=layers, seq_len=seq_len)
    target = target_of(path, world, device="cuda")
    on_device = measure(target, Choice(2, 2, 1, Levers(True)))
    offloaded = measure(target, Choice(2, 2, 1, Levers("offload")))
    per_layer = (seq_len // world) * target.model.hidden_size * 2  # bf16 [tokens, hidden]
    forward, backward = 0, 1  # phases: forward 0, backward 0, clip, optimizer
    assert on_device.phases[forward].device - offloaded.phases[forward].device == (
        layers * per_layer
    )
    # in backward, whole layer inputs: all but the one being recomputed, or all of them
    # when the peak comes before the first recompute (where it is depends on the norm's
    # and the attention's temporaries: usp.planner.explain shows it)
    dropped, rest = divmod(on_device.phases[backward].device - offloaded.phases[backward].device,
                           per_layer)  # fmt: skip
    assert rest == 0 and 1 <= dropped <= layers, (dropped, rest)
    assert offloaded.peak_host == layers * per_layer and on_device.peak_host == 0
    assert offloaded.peak_device == on_device.peak_device - dropped * per_layer
    assert offloaded.host_separated and on_device.host_separated
    # the same measured at depth 3 and 4 and extrapolated: the host line continues too
    deep = write_config(tmp_path, layers=6, seq_len=seq_len)
    scaled = measure_scaled(
        target_of(deep, world, device="cuda"), Choice(2, 2, 1, Levers("offload"))
    )
    assert scaled.peak_host == 6 * per_layer


def test_offload_host_device_is_a_hook_real_runs_keep_on_the_cpu():
    """The offloader's host copies go to ``host_device`` (the CPU unless a memory estimate
    says otherwise) and come back equal, on the tensor's own device."""
    from usp.models.offload import HostOffloader

    offloader = HostOffloader()
    assert offloader.host_device == torch.device("cpu")
    x = torch.randn(4, 3, requires_grad=True)
    with offloader.hold(x):
        y = (x * x).sum()  # mul saves x (twice): both through the hooks
    y.backward()
    assert torch.equal(x.grad, 2 * x.detach())


# ----------------------------------------------------------------------------- optimizer
def test_a_cuda_plans_adamw_holds_the_foreach_updates_temporary(tmp_path):
    """On CUDA, torch's AdamW runs its foreach update (FSDP2's DTensor parameters are on
    ``cuda``), which holds ``sqrt(exp_avg_sq)`` of a whole parameter group at once (float32,
    the local shards): the planned optimizer phase holds exactly that on top of the two
    moments and the step counts (the tracker files the update's temporaries under the
    optimizer state), not the single-tensor update's one-parameter temporary."""
    from usp.planner.measure import built_step

    target = target_of(write_config(tmp_path, seq_len=256), 4, device="cuda")
    choice = Choice(2, 2, 1, Levers(True))
    optimizer_phase = measure(target, choice).phases[-1].breakdown
    with built_step(target, choice) as built:
        shards = [p.to_local() for p in built.model.parameters()]
        assert all(s.dtype == torch.float32 for s in shards)  # fp32 master weights
        decayed = sum(4 * s.numel() for s in shards if s.dim() >= 2)  # the larger group
        params = sum(4 * s.numel() for s in shards)
    assert optimizer_phase["parameters"] == params
    steps = 4 * len(shards)  # a float32 step count per parameter
    assert optimizer_phase["optimizer_state"] == 2 * params + steps + decayed


# ----------------------------------------------------------------------------- traffic
def test_fsdp_traffic_by_hand():
    """4 ranks, 2 layers of 100 parameters and 50 others, bf16 gathers, fp32 reduction:
    layer 0 gathered twice, layer 1 once (kept from forward), the root once."""
    t = fsdp_traffic(100, 50, 2, world=4, compute_bytes=2, reduce_bytes=4)
    assert t["fsdp_all_gather"]["received"] == int((2 * 100 + 100 + 50) * 2 * 3 / 4)
    assert t["fsdp_reduce_scatter"]["sent"] == int((2 * 100 + 50) * 4 * 3 / 4)


# ----------------------------------------------------------------------------- the command
def plan_cli(capsys, *argv, jobs=1):
    """``usp plan`` (``--jobs 1``, in this process: a tiny plan spends more starting
    workers than measuring; the JSON test below also runs it with two workers)."""
    code = main(["plan", *map(str, argv), "--jobs", str(jobs)])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_ranks_every_layout_and_finds_the_longest_sequence(tmp_path, capsys):
    """The whole search (every candidate, the longest sequence's probes) of the one-layer
    tiny model on 2 CPU ranks, the file's cluster and length overridden by flags; run in
    process and in two worker processes: the same JSON, all but the seconds it took (what
    the worker pool must keep, usp.planner.pool). (The text form of a plan:
    tests/planner/test_planner_progress.py.)"""
    path = write_config(tmp_path, gpus=8, layers=1, seq_len=1024)
    plans = []
    for jobs in (1, 2):
        code, out, err = plan_cli(
            capsys, path, "--json", "--nodes", 1, "--gpus-per-node", 2, "--seq-len", 512,
            "--device", "cpu", "--host-memory-gib", 64, "--gpu-memory-gib", 0.01, jobs=jobs,
        )  # fmt: skip
        assert code == 0, err
        plans.append(json.loads(out))
        plans[-1].pop("seconds")
    assert plans[0] == plans[1]
    plan = plans[0]
    assert plan["seq_len"] == 512 and plan["world_size"] == 2
    grids = {(c["ulysses"], c["ring"], c["dp"]) for c in plan["candidates"]}
    assert grids == {(1, 2, 1), (2, 1, 1)}  # global_batch 1: no dp
    assert {c["activation_checkpointing"] for c in plan["candidates"]} == {True, False, "offload"}
    # 2 grids x 7 lever sets (5 for activations, then the optimizer's and the parameters'
    # offload on top of the last), and on u1 x r2 (2 KV heads per ring) one with head chunks
    assert len(plan["candidates"]) == 15
    chunked = [c for c in plan["candidates"] if c["attention_head_chunks"] > 1]
    assert {(c["ulysses"], c["attention_head_chunks"]) for c in chunked} == {(1, 2)}
    offloaded = [(c["offload_optimizer"], c["offload_parameters"]) for c in chunked]
    assert sorted(offloaded) == [(False, False), (True, False), (True, True)]
    for c in plan["candidates"]:
        # a CPU rank: its step plus a 1% margin within its share (no CUDA overheads)
        names = {i["name"] for i in c["overheads"] if i["added"]}
        assert names == {"margin"}, names
        assert c["device_total_gib"] == pytest.approx(c["peak_device_gib"] + 1e-4, abs=2e-3)
        if abs(c["device_total_gib"] - 0.01) > 2e-3:  # (clear of the boundary's rounding)
            assert c["fits"] == (c["device_total_gib"] <= 0.01)
        assert c["tokens_per_rank"] == 256
        assert c["comm_bytes_per_step"]["fsdp_all_gather"] > 0
    assert plan["best"] == plan["candidates"][0] and plan["best"]["fits"]
    fitting = [c for c in plan["candidates"] if c["fits"]]
    assert plan["best"]["step_time_s_estimate"] == min(c["step_time_s_estimate"] for c in fitting)
    # the longest fitting sequence: a multiple of the layout's need, longer than 512 here
    assert plan["max_seq_len"] > 512 and plan["max_seq_len"] % 4 == 0
    # ... with the layout and levers that reach it, and that layout measured there
    choice = plan["max_seq_len_layout"]
    assert set(choice) == {
        "ulysses", "ring", "dp", "activation_checkpointing", "mlp_tile_tokens",
        "attention_head_chunks", "offload_optimizer", "offload_parameters",
    }  # fmt: skip
    at_longest = plan["max_seq_len_candidate"]
    assert {k: at_longest[k] for k in choice} == choice and at_longest["fits"]
    sp = choice["ulysses"] * choice["ring"]
    assert at_longest["tokens_per_rank"] * sp == plan["max_seq_len"]


def test_plan_errors_exit_2_with_a_message(tmp_path, capsys):
    code, _, err = plan_cli(capsys, tmp_path / "missing.toml")
    assert code == 2 and "no such config file" in err

    heads = "num_attention_heads = 4\nnum_key_value_heads = 3"
    path = write_config(tmp_path, gpus=2, extra_model=heads)
    code, _, err = plan_cli(capsys, path)
    assert code == 2 and "must be a multiple of num_key_value_heads(3)" in err, err

    path = write_config(tmp_path, gpus=1, layers=1, seq_len=256)  # (one grid: u1 x r1)
    code, out, err = plan_cli(capsys, path, "--gpu-memory-gib", 1e-6)
    assert code == 2 and "no layout fits 256 tokens" in err, err
    assert "ulysses ring" in out  # the table still says what each layout needs


def test_plan_check_script_compares_on_this_device(tmp_path):
    """benchmarks/plan_check.py (the GPU check's planner step) at a CPU size."""
    from usp_cases import load_benchmark

    plan_check = load_benchmark("plan_check")
    argv = ["--preset", "tiny", "--layers", "1", "--seq-len", "2048", "--world", "2",
            "--ulysses", "2", "--ring", "1", "--out", str(tmp_path)]  # fmt: skip
    assert plan_check.main(argv) == 0
    row = json.loads((tmp_path / "plan_check.json").read_text())
    assert row["device"] == "cpu" and 0.9 <= row["ratio"] <= 1.1


# ----------------------------------------------------------------------------- cluster keys
def test_cluster_keys_set_the_memory_limit_and_the_links(tmp_path):
    from usp.planner.plan import _cluster
    from usp.planner.search import Choice, comm_bytes, step_time

    text = write_config(tmp_path, gpus=4, global_batch=2).read_text().replace(
        "gpus_per_node = 4", 'gpus_per_node = 4\ngpu = "A100"\nintra_node_gbps = 100\ninter_node_gbps = 5'
    )  # fmt: skip
    path = tmp_path / "a100.toml"
    path.write_text(text)
    job = load_train_config(path)
    cluster, gpu = _cluster(job, 2, None, None, None, "cuda")
    assert (gpu, cluster.gpu_memory_gib, cluster.world_size) == ("A100", 79.2, 8)
    assert (cluster.intra_node_gbps, cluster.inter_node_gbps) == (100, 5)
    # a ring across the two nodes is bound by the 5 GB/s link, one inside a node is not
    target = target_of(path, 8, device="cuda")
    across, inside = Choice(4, 2, 1), Choice(4, 1, 2)
    sent = comm_bytes(target, across)
    assert sent["attention_p2p"] > 0 and sent["attention_all_to_all"] > 0
    slow = step_time(target, across, cluster, sent)
    fast = step_time(target, across, replace_links(cluster, 50), sent)
    assert slow > fast
    assert step_time(target, inside, cluster, comm_bytes(target, inside)) > 0


def replace_links(cluster, inter):
    from dataclasses import replace

    return replace(cluster, inter_node_gbps=inter)


@pytest.mark.parametrize(
    "line, message",
    [
        ('gpu = "B300"', "[cluster] gpu = 'B300': its memory is not known here"),
        ("inter_node_gbps = 0", "[cluster] inter_node_gbps must be a number > 0"),
    ],
)
def test_bad_cluster_keys_exit_2(tmp_path, capsys, line, message):
    text = (
        write_config(tmp_path, gpus=2)
        .read_text()
        .replace("gpus_per_node = 2", f"gpus_per_node = 2\n{line}")
    )
    path = tmp_path / "bad.toml"
    path.write_text(text)
    code, _, err = plan_cli(capsys, path, "--device", "cuda")
    assert code == 2 and message in err, err


class LinearMemory:
    """A stand-in for the plan's measurements: each layout's device and host peaks are
    ``base + per_token * seq_len`` bytes (what a real step's are, close to), and every
    length asked for is recorded."""

    jobs = 1

    def __init__(self, device_per_token, host_per_token, base=0):
        self.device_per_token, self.host_per_token, self.base = (
            device_per_token, host_per_token, base,
        )  # fmt: skip
        self.asked: list[int] = []

    def want(self, choice, seq_len, *, urgent=False):
        pass

    def footprint(self, choice, seq_len):
        from usp.planner.footprint import Footprint, Phase

        self.asked.append(seq_len)
        device = self.base + self.device_per_token * seq_len
        return Footprint((Phase(device, self.host_per_token * seq_len),), layers=2)


@pytest.mark.parametrize(
    "device_per_token, host_per_token, bound",
    [
        (2**20, 0, "device"),  # 1 MiB per token on the device, nothing on the host
        (2**10, 2**20, "host"),  # offload: the host fills first
        (2**20, 2**20 + 2**18, "host"),  # both grow, the host faster
    ],
)
def test_the_longest_sequence_is_where_the_first_limit_binds(
    tmp_path, device_per_token, host_per_token, bound
):
    """The search predicts from both limits (a line through two lengths), measures the
    prediction and the next multiple, and returns the exact boundary: the longest
    multiple that fits, whose next multiple does not."""
    from usp.planner import search

    target = target_of(write_config(tmp_path, gpus=2, seq_len=256), 2)
    choice = Choice(1, 2, 1, Levers(True))
    multiple = search.sequence_multiple(choice, target.job)  # 4: zigzag on a ring of 2
    cluster = search.Cluster(1, 2, gpu_memory_gib=1.0, host_memory_gib=2.0)
    measured = LinearMemory(device_per_token, host_per_token, base=3 * 2**20)
    longest, chosen = search.max_seq_len(target, [choice], cluster, measured)
    budget = search.overheads(target, choice, cluster).budget()

    def fits(s):
        return search.judge(
            measured.footprint(choice, s), search.overheads(target, choice, cluster)
        )[0]

    assert chosen == choice and longest % multiple == 0
    assert fits(longest) and not fits(longest + multiple)
    device_limit = budget.device_peak_limit - 3 * 2**20  # (a CPU rank: 99% of its share)
    host_limit = budget.host_peak_limit  # 2 GiB per node over 2 ranks
    assert device_limit == pytest.approx(0.99 * 2**30 - 3 * 2**20, abs=1) and host_limit == 2**30
    device_len = device_limit // device_per_token
    host_len = host_limit // host_per_token if host_per_token else float("inf")
    assert (device_len < host_len) == (bound == "device")
    assert longest == min(device_len, host_len) // multiple * multiple
    assert len(set(measured.asked)) <= 4, "two line points, the prediction, the next multiple"


def test_a_pessimistic_line_is_corrected_by_measuring(tmp_path):
    """A peak that grows slower past the measured lengths (the line overestimates the
    memory): the search measures again from the nearest points and still ends on the
    exact boundary."""
    from usp.planner import search
    from usp.planner.footprint import Footprint, Phase

    class Bent(LinearMemory):
        def footprint(self, choice, seq_len):
            self.asked.append(seq_len)
            slope = 2**19  # per token past 256: half the line's slope below it
            device = 2**20 * min(seq_len, 256) + slope * max(0, seq_len - 256)
            return Footprint((Phase(device, 0),), layers=2)

    target = target_of(write_config(tmp_path, gpus=2, seq_len=256), 2)
    choice = Choice(1, 2, 1, Levers(True))
    cluster = search.Cluster(1, 2, gpu_memory_gib=1.0, host_memory_gib=2.0)
    measured = Bent(0, 0)
    longest, _ = search.max_seq_len(target, [choice], cluster, measured, rounds=6)
    limit = search.overheads(target, choice, cluster).budget().device_peak_limit
    expected = int(256 + (limit - 2**28) // 2**19) // 4 * 4
    assert longest == expected


@pytest.mark.parametrize("pieces", [False, True])
def test_the_search_steps_down_a_pinned_rounding_cliff(tmp_path, monkeypatch, pieces):
    """Offloaded layer inputs on CUDA: a pinned block takes the next power of two, so
    held as one block (``pieces=False``: no power-of-two piece small enough) the host's
    need jumps where a block passes 2^k bytes. The search adds that rounding exactly to
    its line and ends at the last length below the jump (a plain line through two
    lengths below it predicted far past it, and kept missing). Held in pieces (the
    default: usp.models.offload.pinned_pieces) the rounding is at most one small piece
    a layer, and the longest goes past that cliff to what the bytes themselves allow."""
    import usp.models.offload as offload_module
    from usp.planner import search

    if not pieces:
        monkeypatch.setattr(offload_module, "MIN_PIECE_ELEMENTS", 2**62)
    from usp.planner.footprint import Extras, Footprint, Phase
    from usp.planner.measure import offload_rounding

    target = target_of(write_config(tmp_path, gpus=2, seq_len=4096), 2, device="cuda")
    choice = Choice(1, 2, 1, Levers("offload"))
    layers = target.model.num_hidden_layers
    block = target.model.hidden_size * 2 // 2  # bytes per global token of one block (bf16, sp 2)

    class Offloaded(LinearMemory):
        def footprint(self, layout_, seq_len):
            self.asked.append(seq_len)
            rounding = offload_rounding(target, choice, seq_len, layers)
            host = layers * block * seq_len  # the layer inputs, exactly
            return Footprint((Phase(2**20, host),), layers=layers, extras=Extras(pinned=rounding))

    measured = Offloaded(0, 0)
    cluster = search.Cluster(1, 2, 1000.0, 64.0, gpu="H100")  # 20 GiB of host per rank
    limit = search.overheads(target, choice, cluster).budget().host_peak_limit
    longest, chosen = search.max_seq_len(target, [choice], cluster, measured)
    multiple = search.sequence_multiple(choice, target.job)

    def host_total(s):
        return measured.footprint(choice, s).host_total

    assert chosen == choice and host_total(longest) <= limit < host_total(longest + multiple)
    boundary = limit / layers  # the largest power of two block that fits
    cliff = 2 ** math.floor(math.log2(boundary)) // block // multiple * multiple
    if not pieces:
        assert longest == cliff
    else:  # within one multiple and one small piece's rounding a layer of the bytes' limit
        waste = 2 * offload_module.MIN_PIECE_ELEMENTS * 2  # under 2 pieces' bytes (bf16)
        assert cliff < longest
        assert limit - layers * (waste + block * multiple) <= host_total(longest)
    assert len(set(measured.asked)) <= 6
