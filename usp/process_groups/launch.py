"""What the launcher actually started: every rank's node, observed once at run time.

torchrun tells each process where it runs through its environment: ``GROUP_RANK`` (the
node's index among torchrun's agents), ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` (its place
and the number of processes on that node). Other launchers set ``NODE_RANK`` or nothing;
the host name is always there. :func:`observe_launch` exchanges these facts once with one
tensor all-gather (no object collectives: no pickling, no numpy), and
:meth:`Launch.from_ranks` turns them into a node per rank. That second step is pure, so
it is tested on any layout without processes.

Two ranks share a node when they report the same ``GROUP_RANK`` (or ``NODE_RANK``) and
the same host name. Nodes are numbered in the order of their lowest rank, which under
torchrun is ``GROUP_RANK`` itself (torchrun gives each node consecutive global ranks in
``GROUP_RANK`` order); the assignment need not be contiguous for other launchers.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from usp.comm.collectives import all_gather_uncounted
from usp.process_groups.rank_math import TopologyError, describe_node_shape, node_sizes_of

UNSET = -1  # the variable is not in the environment
UNPARSABLE = -2  # the variable is set but is not an integer >= 0
_FIELDS = ("group_rank", "local_rank", "local_world_size", "host_id")
_ENV_NAMES = {
    "group_rank": ("GROUP_RANK", "NODE_RANK"),
    "local_rank": ("LOCAL_RANK",),
    "local_world_size": ("LOCAL_WORLD_SIZE",),
}


@dataclass(frozen=True)
class RankLaunch:
    """What one process knows about its own place from its environment.

    Integers so that they travel in one int64 tensor: ``UNSET`` (-1) when the variable is
    absent, ``UNPARSABLE`` (-2) when it is not an integer >= 0. ``host_id`` is a stable
    64-bit hash of the host name (Python's ``hash`` is salted per process).
    """

    group_rank: int
    local_rank: int
    local_world_size: int
    host_id: int

    def as_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor([getattr(self, f) for f in _FIELDS], dtype=torch.int64, device=device)


def host_id(hostname: str) -> int:
    digest = hashlib.blake2b(hostname.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _env_int(environ: Mapping[str, str], names: tuple[str, ...]) -> int:
    for name in names:
        value = environ.get(name)
        if value is None:
            continue
        try:
            number = int(value)
        except ValueError:
            return UNPARSABLE
        return number if number >= 0 else UNPARSABLE
    return UNSET


def rank_launch_from_env(
    environ: Mapping[str, str] | None = None, hostname: str | None = None
) -> RankLaunch:
    """This process's :class:`RankLaunch` (from ``os.environ`` and the host name)."""
    environ = os.environ if environ is None else environ
    hostname = socket.gethostname() if hostname is None else hostname
    return RankLaunch(
        group_rank=_env_int(environ, _ENV_NAMES["group_rank"]),
        local_rank=_env_int(environ, _ENV_NAMES["local_rank"]),
        local_world_size=_env_int(environ, _ENV_NAMES["local_world_size"]),
        host_id=host_id(hostname),
    )


@dataclass(frozen=True)
class Launch:
    """The running job's shape: which node every rank runs on.

    ``node_of_rank[rank]`` is the node id (``0 .. num_nodes-1``, in order of each node's
    lowest rank); ``launcher`` names who started the job in messages ("torchrun" when
    every rank reports a ``GROUP_RANK``/``NODE_RANK``).
    """

    node_of_rank: tuple[int, ...]
    launcher: str

    @classmethod
    def from_ranks(cls, ranks: Sequence[RankLaunch]) -> Launch:
        """Group ranks into nodes and check that the environment is consistent.

        Raises :class:`TopologyError` (the same one on every rank, since all ranks see the
        same facts) when a variable is malformed, one node id is reported from two hosts,
        or a node's ``LOCAL_WORLD_SIZE``/``LOCAL_RANK`` contradict the ranks found on it.
        """
        if not ranks:
            raise TopologyError("a launch needs at least one rank")
        _check_parsable(ranks)
        node_ids: dict[tuple[int, int], int] = {}
        node_of_rank = []
        for r in ranks:
            key = (r.group_rank, r.host_id)
            node_of_rank.append(node_ids.setdefault(key, len(node_ids)))
        launch = cls(
            node_of_rank=tuple(node_of_rank),
            launcher="torchrun" if all(r.group_rank >= 0 for r in ranks) else "the launcher",
        )
        _check_group_ranks_on_one_host(ranks)
        _check_local_sizes(ranks, launch)
        return launch

    @property
    def world_size(self) -> int:
        return len(self.node_of_rank)

    @property
    def node_sizes(self) -> tuple[int, ...]:
        return node_sizes_of(self.node_of_rank)

    @property
    def num_nodes(self) -> int:
        return len(self.node_sizes)

    @property
    def uniform(self) -> bool:
        """Every node runs the same number of ranks."""
        return len(set(self.node_sizes)) == 1

    @property
    def contiguous(self) -> bool:
        """Every node's ranks are consecutive (as torchrun numbers them)."""
        return all(a <= b for a, b in zip(self.node_of_rank, self.node_of_rank[1:]))

    def describe(self) -> str:
        """``"2 nodes x 2 ranks"``; notes an interleaved rank -> node assignment."""
        text = describe_node_shape(self.node_sizes)
        if not self.contiguous:
            text += " (ranks interleaved across nodes)"
        return text

    def launched(self) -> str:
        """``"torchrun launched 2 nodes x 2 ranks"``, for error messages."""
        if self.launcher == "torchrun":
            return f"torchrun launched {self.describe()}"
        return f"the job runs on {self.describe()}"


def _check_parsable(ranks: Sequence[RankLaunch]) -> None:
    for field in ("group_rank", "local_rank", "local_world_size"):
        bad = [i for i, r in enumerate(ranks) if getattr(r, field) == UNPARSABLE]
        if bad:
            names = " or ".join(_ENV_NAMES[field])
            raise TopologyError(
                f"{names} is not an integer >= 0 in the environment of rank(s) "
                f"{_short(bad)}: the launch cannot be read"
            )


def _check_group_ranks_on_one_host(ranks: Sequence[RankLaunch]) -> None:
    hosts: dict[int, tuple[int, int]] = {}  # group rank -> (host id, first rank)
    for rank, r in enumerate(ranks):
        if r.group_rank < 0:
            continue
        host, first = hosts.setdefault(r.group_rank, (r.host_id, rank))
        if host != r.host_id:
            raise TopologyError(
                f"ranks {first} and {rank} report the same node (GROUP_RANK/NODE_RANK "
                f"{r.group_rank}) from different hosts: the launch environment is inconsistent"
            )


def _check_local_sizes(ranks: Sequence[RankLaunch], launch: Launch) -> None:
    sizes = launch.node_sizes
    seen_local: dict[tuple[int, int], int] = {}
    for rank, (r, node) in enumerate(zip(ranks, launch.node_of_rank)):
        if r.local_world_size >= 0 and r.local_world_size != sizes[node]:
            raise TopologyError(
                f"rank {rank} has LOCAL_WORLD_SIZE={r.local_world_size}, but {sizes[node]} "
                f"rank(s) run on its node (node {node}); {launch.launched()}: "
                "the launch environment is inconsistent"
            )
        if r.local_rank >= 0:
            other = seen_local.setdefault((node, r.local_rank), rank)
            if other != rank:
                raise TopologyError(
                    f"ranks {other} and {rank} both have LOCAL_RANK={r.local_rank} on node "
                    f"{node}: the launch environment is inconsistent"
                )


def _short(values: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, values[:limit]))
    return shown + (f", ... ({len(values)} ranks)" if len(values) > limit else "")


# ----------------------------------------------------------------------------- collective
def can_observe_launch() -> bool:
    """False for the ``fake`` backend, whose collectives return without data."""
    return dist.get_backend() != "fake"


def exchange_device(device_type: str) -> torch.device:
    """Where a small collective of the default group runs: CPU when the default group
    has gloo (including ``"cpu:gloo,cuda:nccl"``), else this rank's current GPU."""
    if "gloo" in dist.get_backend() or device_type == "cpu":
        return torch.device("cpu")
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def tensorless_barrier(device_type: str) -> None:
    """A barrier on the default group that hands no Python tensor to the backend.

    Gloo's worker threads release a finished collective's tensors after ``wait()`` has
    returned; for a tensor created in Python that needs the GIL, and once the
    interpreter is shutting down the thread is stopped inside a C++ destructor:
    "terminate called without an active exception" (SIGABRT) at exit. ``dist.barrier``
    makes its tensor in C++, so when it is the last collective before exit nothing is
    left for a worker thread to hand back to Python.
    """
    if device_type == "cuda" and "nccl" in dist.get_backend():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def observe_launch(device_type: str = "cpu", environ: Mapping[str, str] | None = None) -> Launch:
    """Every rank's :class:`RankLaunch`, exchanged once over the default group.

    Collective: every rank must call it. One all-gather of ``4 * world_size`` int64
    values; errors are raised after the exchange, identically on every rank.
    """
    mine = rank_launch_from_env(environ).as_tensor(exchange_device(device_type))
    world_size = dist.get_world_size()
    everyone = torch.empty(world_size * len(_FIELDS), dtype=torch.int64, device=mine.device)
    all_gather_uncounted(everyone, mine, None)  # the default group
    rows = everyone.view(world_size, len(_FIELDS)).tolist()
    del mine, everyone
    # The caller may raise and exit right away (a launch that contradicts the config).
    # Gloo's worker thread frees the all-gather's Python-made tensors after wait() has
    # returned and needs the GIL for that; a tensorless barrier lets it do so before any
    # interpreter shutdown, which would otherwise abort the process (see Topology.destroy).
    tensorless_barrier(device_type)
    return Launch.from_ranks([RankLaunch(*row) for row in rows])
