"""``usp plan``'s shortcuts are exact: the planning tracker against torch's plain one, the
worker pool against the measurements in process, the search's schedule against the
plain order. (The whole search in process and in two workers gives the same JSON:
``test_plan_json_ranks_every_layout_and_finds_the_longest_sequence`` in
tests/planner/test_planner.py.)"""

import os
import signal

import pytest
import torch
from planner_cases import target_of, write_config
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from usp.cli import main
from usp.errors import InputError
from usp.models import Levers
from usp.planner.footprint import Choice
from usp.planner.measure import measure, measure_scaled
from usp.planner.pool import Measurements, WorkerError, default_jobs
from usp.planner.tracker import PlanningTracker, returns_no_tensor

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


# ----------------------------------------------------------------------------- tracker
def test_returns_no_tensor_reads_the_schema():
    ops = torch.ops
    assert returns_no_tensor(ops.prim.device.default)
    assert returns_no_tensor(ops.aten.sym_size.int)
    assert returns_no_tensor(ops.aten.is_contiguous.default)
    assert returns_no_tensor(ops.aten._foreach_add_.Scalar)  # in place, returns nothing
    assert not returns_no_tensor(ops.aten.mm.default)
    assert not returns_no_tensor(ops.aten.split.Tensor)  # Tensor[]
    assert not returns_no_tensor(ops.aten._scaled_dot_product_cudnn_attention.default)
    assert not returns_no_tensor(ops.c10d._allgather_base_.default)  # (Tensor, Work)


class CountingTracker(PlanningTracker):
    """The planning tracker, counting the ops that took its fast path."""

    fast = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if returns_no_tensor(func):
            CountingTracker.fast += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize(
    "choice, device, global_batch",
    [
        (Choice(2, 2, 1, Levers(True)), "cpu", 1),
        (Choice(1, 4, 1, Levers("offload", 64)), "cuda", 1),  # bf16, host stand-in, MLP tiles
        (Choice(4, 1, 1, Levers(False)), "cuda", 2),  # two micro-batches
    ],
)
def test_planning_tracker_footprint_equals_the_plain_trackers(
    tmp_path, choice, device, global_batch
):
    """Every phase's device and host peak and its breakdown, byte for byte."""
    path = write_config(tmp_path, seq_len=1024, global_batch=global_batch)
    target = target_of(path, 4, device)
    CountingTracker.fast = 0
    fast = measure(target, choice, tracker=CountingTracker)
    plain = measure(target, choice, tracker=FSDPMemTracker)
    assert CountingTracker.fast > 100  # the fast path ran (every .device query is one)
    assert fast == plain
    assert fast.peak_device > 0 and len(fast.phases) == 2 * global_batch + 2
    if choice.levers.activation_checkpointing == "offload":
        assert fast.peak_host > 0


# ----------------------------------------------------------------------------- tiles
class OpCountingTracker(PlanningTracker):
    """The planning tracker, counting every op it sees."""

    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        OpCountingTracker.ops += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _ops_and_footprint(target, choice, representative):
    OpCountingTracker.ops = 0
    footprint = measure(target, choice, tracker=OpCountingTracker, representative=representative)
    return OpCountingTracker.ops, footprint


@pytest.mark.parametrize(
    "choice, device, global_batch",
    [
        (Choice(2, 2, 1, Levers(True)), "cpu", 1),
        (Choice(1, 4, 1, Levers("offload", 8192)), "cuda", 1),  # bf16, host stand-in, MLP tiles
        (Choice(4, 1, 1, Levers(False)), "cuda", 2),  # two micro-batches
    ],
)
def test_representative_tiles_give_the_full_loops_footprint(tmp_path, choice, device, global_batch):
    """usp.models.tiling: with 3.5 tiles of RMSNorm (8192 tokens) per rank, the first and
    the last tile give every phase's peak and breakdown of all of them, byte for byte,
    with fewer ops."""
    from usp.models.norm import NORM_CHUNK_TOKENS

    per_rank = 3 * NORM_CHUNK_TOKENS + NORM_CHUNK_TOKENS // 2
    path = write_config(tmp_path, seq_len=4 * per_rank, global_batch=global_batch)
    target = target_of(path, 4, device)
    full_ops, full = _ops_and_footprint(target, choice, representative=False)
    fewer_ops, representative = _ops_and_footprint(target, choice, representative=True)
    assert representative == full
    assert fewer_ops < full_ops  # (the mode took effect: the middle tiles did not run)


@pytest.mark.parametrize(
    "choice, device",
    [
        (Choice(1, 4, 1, Levers(True, 0, 4)), "cpu"),
        (Choice(1, 2, 2, Levers("offload", 0, 4)), "cuda"),  # bf16, host stand-in, dp 2
    ],
)
def test_representative_head_groups_give_every_groups_footprint(tmp_path, choice, device):
    """usp.ring.heads: one KV head per ring pass (4 groups of 8 query heads over 4 KV
    heads), the first and the last group give every phase's peak and breakdown of all
    four, byte for byte, with fewer ops."""
    heads = "num_attention_heads = 8\nnum_key_value_heads = 4"
    path = write_config(tmp_path, seq_len=1024, global_batch=choice.dp, extra_model=heads)
    target = target_of(path, 4, device)
    full_ops, full = _ops_and_footprint(target, choice, representative=False)
    fewer_ops, representative = _ops_and_footprint(target, choice, representative=True)
    assert representative == full
    assert fewer_ops < full_ops  # (the middle groups did not run)


# ----------------------------------------------------------------------------- workers
def plan_cli(capsys, *argv):
    code = main(["plan", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_scaled_footprints_from_workers_equal_the_in_process_ones(tmp_path):
    """Depth-scaled (3 and 4 layers of 6, both in one worker), two lengths, two jobs."""
    target = target_of(write_config(tmp_path, layers=6, seq_len=256), 4)
    choice = Choice(2, 2, 1, Levers(True))
    with Measurements(target, jobs=2) as measured:
        measured.want(choice, 256)
        measured.want(choice, 512, urgent=True)
        got = {s: measured.footprint(choice, s) for s in (256, 512)}
        assert measured.runs == 4  # 2 lengths x depths 3 and 4
    for seq_len, footprint in got.items():
        assert footprint == measure_scaled(target.at(seq_len), choice)
        assert footprint.layers == 6


def test_an_error_in_a_worker_ends_the_plan_as_it_does_in_process(tmp_path, capsys):
    """A user error raised inside a measurement (a CUDA-only backend on a CPU plan):
    the same message and exit status 2 with --jobs 1 and --jobs 2, and no worker left."""
    import multiprocessing

    path = write_config(tmp_path, gpus=2, backend="cudnn")
    errors = []
    # (other tests' process pools, e.g. the gloo harness's, may be alive: not the plan's)
    before = set(multiprocessing.active_children())
    for jobs in (1, 2):
        # --quiet: the progress lines say where it measures, which differs by --jobs
        code, out, err = plan_cli(capsys, path, "--device", "cpu", "--jobs", jobs, "--quiet")
        assert code == 2 and out == "", (code, out, err)
        errors.append(err)
    assert errors[0] == errors[1]
    assert "backend = 'cudnn' runs on CUDA only" in errors[0]
    assert set(multiprocessing.active_children()) <= before, "the plan's workers are gone"


def test_a_worker_that_dies_ends_the_plan_with_a_message(tmp_path):
    target = target_of(write_config(tmp_path, seq_len=256), 4)
    choice = Choice(2, 2, 1, Levers(True))
    measured = Measurements(target, jobs=2)
    measured.want(choice, 256)
    measured.want(Choice(1, 4, 1, Levers(True)), 256)
    for process in list(measured._executor._processes.values()):
        os.kill(process.pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="worker process died .* rerun with --jobs 1"):
        measured.footprint(choice, 256)
    measured.close()  # (closed already: a no-op)


def test_jobs_flag(tmp_path, capsys):
    assert default_jobs() == min(2, os.cpu_count())
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(write_config(tmp_path)), "--jobs", "0"])
    assert exit_.value.code == 2 and "expected an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(InputError, match="jobs must be >= 1"):
        Measurements(None, jobs=0)


def test_the_search_also_takes_a_plain_dict_as_its_cache(tmp_path):
    """``search.evaluate`` and ``search.max_seq_len`` with a dict (in process, as before
    Measurements): the same candidate and the same longest sequence."""
    from usp.planner import search

    target = target_of(write_config(tmp_path, gpus=2, layers=1, seq_len=256), 2)
    cluster = search.Cluster(1, 2, 0.01, 64.0)
    choices = [Choice(1, 2, 1, Levers(True))]
    cache: dict = {}
    with Measurements(target, jobs=1) as measured:
        assert search.evaluate(target, choices[0], cluster, cache) == search.evaluate(
            target, choices[0], cluster, measured
        )
        longest = search.max_seq_len(target, choices, cluster, measured)
    assert search.max_seq_len(target, choices, cluster, cache) == longest
    assert longest[0] > 256 and (choices[0], 256) in cache
