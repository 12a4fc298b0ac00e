"""Bytes on the wire, counted alike for every peer: a ``TorchDispatchMode`` over the
``c10d`` and functional-collective ops (:class:`CollectiveCounter`), in the convention of
``usp.comm.stats.CommStats``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group(arg) -> dist.ProcessGroup:
    """The process group of a c10d op argument (boxed) or a functional op's group name."""
    if isinstance(arg, dist.ProcessGroup):
        return arg
    if isinstance(arg, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(arg)
    return dist.ProcessGroup.unbox(arg)


def _split_bytes(t: torch.Tensor, splits, rank: int, size: int) -> int:
    """Bytes of an all-to-all buffer (split along dim 0) that go to or come from others."""
    total = _nbytes(t)
    if not splits:
        return total * (size - 1) // size
    row = total // t.shape[0] if t.shape[0] else 0
    return sum(n for j, n in enumerate(splits) if j != rank) * row


def _all_to_all_bytes(output, inp, out_splits, in_splits, group) -> tuple[int, int]:
    rank, size = group.rank(), group.size()
    return (
        _split_bytes(inp, in_splits, rank, size),
        _split_bytes(output, out_splits, rank, size),
    )


def _collective_traffic(op: str, args: tuple, result) -> tuple[str, int, int, int] | None:
    """(kind, sent, received, calls) of one collective op, in the convention of
    ``usp.comm.stats.CommStats``: the part a rank keeps is not counted; an all-gather sends the local
    block to each of the other ranks; a reduce-scatter sends all but the kept slice; an
    all-reduce counts a ring's 2 (n - 1) / n; a receive counts no call. None: not traffic."""
    if op == "send":
        return "p2p", sum(_nbytes(t) for t in args[0]), 0, 1
    if op == "recv_":
        return "p2p", 0, sum(_nbytes(t) for t in args[0]), 0
    if op == "alltoall_base_":
        output, inp, pg, out_splits, in_splits = args[:5]
        return "all_to_all", *_all_to_all_bytes(output, inp, out_splits, in_splits, _group(pg)), 1
    if op == "all_to_all_single":  # functional: (input, out splits, in splits, group name)
        inp, out_splits, in_splits, name = args[:4]
        return "all_to_all", *_all_to_all_bytes(result, inp, out_splits, in_splits, _group(name)), 1
    if op == "alltoall_":
        outputs, inputs, pg = args[:3]
        rank = _group(pg).rank()
        sent = sum(_nbytes(t) for j, t in enumerate(inputs) if j != rank)
        received = sum(_nbytes(t) for j, t in enumerate(outputs) if j != rank)
        return "all_to_all", sent, received, 1
    if op in (
        "_allgather_base_",
        "all_gather_into_tensor",
        "allgather_",
        "allgather_into_tensor_coalesced_",
        "all_gather_into_tensor_coalesced",
    ):
        inputs = _tensors(args[1] if op.endswith("_") else args[0])
        size = _group(args[2]).size() if op.endswith("_") else int(args[1])
        moved = (size - 1) * sum(_nbytes(t) for t in inputs)
        return "all_gather", moved, moved, 1
    if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        outputs = _tensors(args[0])
        size = _group(args[2]).size()
        moved = (size - 1) * sum(_nbytes(t) for t in outputs)
        return "reduce_scatter", moved, moved, 1
    if op in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        size = int(args[2])
        moved = sum(_nbytes(t) for t in _tensors(args[0])) * (size - 1) // size
        return "reduce_scatter", moved, moved, 1
    if op in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_coalesced"):
        size = _group(args[1] if op.endswith("_") else args[2]).size()
        moved = 2 * (size - 1) * sum(_nbytes(t) for t in _tensors(args[0])) // size
        return "all_reduce", moved, moved, 1
    return None


def _tensors(arg) -> list[torch.Tensor]:
    """Flatten a tensor, a list of tensors or a list of lists of tensors."""
    if isinstance(arg, torch.Tensor):
        return [arg]
    return [t for item in arg for t in _tensors(item)]


COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_TRAFFIC = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}


class CollectiveCounter(TorchDispatchMode):
    """Counts the bytes of every collective issued while active, per kind, like
    ``CommStats.snapshot()``; collectives it cannot size are listed in ``unrecognised``.

    Tensor subclasses (DTensor, AsyncCollectiveTensor) run first, so the collectives
    they issue underneath are seen as plain-tensor ops."""

    def __init__(self):
        super().__init__()
        self.traffic: dict[str, dict[str, int]] = {}
        self.unrecognised: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        plain = torch.Tensor.__torch_dispatch__
        if any(getattr(t, "__torch_dispatch__", plain) is not plain for t in types):
            return NotImplemented
        result = func(*args, **(kwargs or {}))
        schema = getattr(func, "_schema", None)  # higher-order operators have none
        namespace, _, op = schema.name.partition("::") if schema else ("", "", "")
        if namespace in COLLECTIVE_NAMESPACES and op not in NOT_TRAFFIC:
            counted = _collective_traffic(op, args, result)
            if counted is None:
                self.unrecognised.add(schema.name)
            else:
                kind, sent, received, calls = counted
                entry = self.traffic.setdefault(kind, {"sent": 0, "received": 0, "calls": 0})
                entry["sent"] += sent
                entry["received"] += received
                entry["calls"] += calls
        return result


def count_passes(case) -> dict:
    """One forward and one backward of ``case`` (a :class:`benchmarks.peer_cases.Case`),
    each under a ``CollectiveCounter`` (and usp's stats when the case has them)."""
    traffic, stats, unrecognised = {}, {}, set()
    out = None
    for phase in ("forward", "backward"):
        if case.comm_stats is not None:
            case.comm_stats.reset()
        with CollectiveCounter() as counter:
            if phase == "forward":
                out = case.forward()
            else:
                case.backward(out)
        traffic[phase] = counter.traffic
        unrecognised |= counter.unrecognised
        if case.comm_stats is not None:
            stats[phase] = case.comm_stats.snapshot()
    return {
        "traffic": traffic,
        "comm_stats": stats or None,
        "unrecognised_collectives": sorted(unrecognised),
    }


def total_sent(traffic: dict) -> int:
    return sum(c["sent"] for kinds in traffic.values() for c in kinds.values())
