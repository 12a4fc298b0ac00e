"""The multi-process harness itself: results, errors, deaths and hangs are reported."""

import os
import time

import pytest
import torch
import torch.distributed as dist
from dist_harness import DistributedTestError


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item(), torch.get_num_threads()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank one")
    return "fine"


def _fail_then_others_block():
    if dist.get_rank() == 0:
        raise RuntimeError("rank zero gives up before the collective")
    dist.barrier()  # the others wait for rank 0 forever


def _sleep_forever_in_rank_two():
    if dist.get_rank() == 2:
        time.sleep(3600)
    return "fine"


def _die_on_rank_zero():
    if dist.get_rank() == 0:
        os._exit(3)
    return "fine"


@pytest.mark.parametrize("world_size", [2, 4])
def test_results_come_back_in_rank_order(distributed, world_size):
    results = distributed.run(_rank_and_sum, world_size=world_size)
    expected_sum = world_size * (world_size - 1) / 2
    assert [r[0] for r in results] == list(range(world_size))
    assert all(r[1] == world_size and r[2] == expected_sum for r in results)
    assert all(r[3] == 1 for r in results), "one thread per rank"


def test_an_exception_names_the_rank_and_keeps_its_traceback(distributed):
    with pytest.raises(DistributedTestError) as info:
        distributed.run(_fail_on_rank_one, world_size=2)
    text = str(info.value)
    assert "rank 1: error" in text and "deliberate failure on rank one" in text
    assert "_fail_on_rank_one" in text  # the traceback's frame


def test_ranks_blocked_by_a_failed_rank_are_reported_and_the_pool_recovers(distributed):
    with pytest.raises(DistributedTestError) as info:
        distributed.run(_fail_then_others_block, world_size=2, timeout=60)
    text = str(info.value)
    assert "rank zero gives up" in text and "rank 1: hung" in text
    # the next call gets a fresh pool that works
    assert [r[0] for r in distributed.run(_rank_and_sum, world_size=2)] == [0, 1]


def test_a_hang_fails_after_the_timeout_with_the_stack(distributed):
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        distributed.run(_sleep_forever_in_rank_two, world_size=3, timeout=3)
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert "rank 2: hung" in text and "_sleep_forever_in_rank_two" in text


def test_a_dead_rank_is_reported(distributed):
    with pytest.raises(DistributedTestError) as info:
        distributed.run(_die_on_rank_zero, world_size=2)
    assert "rank 0: died" in str(info.value) and "exit code 3" in str(info.value)
