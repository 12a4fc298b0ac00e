"""Process groups for hybrid sequence parallelism, all owned by one :class:`Topology`.

One ``DeviceMesh`` with axes ``("dp", "ring", "ulysses")`` is built from the pure
:class:`~usp.process_groups.rank_math.RankMap`; every process group comes from that mesh
(its axes and two flattened axes), so there is exactly one owner and no global state.
Whatever needs groups (attention, sharding, loss, FSDP) receives the ``Topology``.

Nodes are observed, not assumed: :func:`build_topology` asks every rank where it runs
(:mod:`usp.process_groups.launch`) before it creates any group, so Ulysses groups are
checked against the nodes the launcher really started.

Lifecycle: ``with build_topology(...) as topo:`` (or ``topo.destroy()``) tears the groups
down after a barrier, so no rank closes its connections while another still uses them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from usp.comm.stats import CommStats
from usp.errors import TopologyDestroyedError  # noqa: F401 - re-exported here
from usp.process_groups.launch import (
    Launch,
    can_observe_launch,
    observe_launch,
    tensorless_barrier,
)
from usp.process_groups.rank_math import (
    ULYSSES_IN_NODE,
    RankMap,
    TopologyError,
    check_degree,
    describe_uniform_nodes,
)

MESH_AXES = ("dp", "ring", "ulysses")
GROUP_NAMES = ("ulysses", "ring", "dp", "sp", "dp_sp")


def default_ranks_per_node(world_size: int, environ: Mapping[str, str] | None = None) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE``, or ``world_size`` (one node) when it is not set.

    Only used where the launch cannot be observed (the ``fake`` backend).
    """
    environ = os.environ if environ is None else environ
    value = environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return world_size
    try:
        return int(value)
    except ValueError:
        raise TopologyError(f"LOCAL_WORLD_SIZE={value!r} is not an integer") from None


def default_device_type() -> str:
    """``"cpu"`` when the default backend is gloo (or CUDA is absent), else ``"cuda"``.

    A mixed backend such as ``"cpu:gloo,cuda:nccl"`` counts as CUDA.
    """
    if not torch.cuda.is_available() or dist.get_backend() == "gloo":
        return "cpu"
    return "cuda"


@dataclass(eq=False)
class Topology:
    """This rank's view of the ``dp x ring x ulysses`` grid and the groups that serve it.

    Build it with :func:`build_topology`. Coordinates follow the conventions of
    :mod:`usp.process_groups.rank_math`: ``ulysses_rank`` and ``ring_rank`` equal this
    rank's group rank in ``ulysses_group`` and ``ring_group``; ``sp_rank`` is
    ``ring_rank * ulysses_degree + ulysses_rank``, which is NOT always
    ``dist.get_rank(sp_group)`` (torch orders the flattened group by global rank; the two
    differ for ``"ring-in-node"``). ``sp_group`` and ``dp_sp_group`` are the WORLD group
    itself when they span the whole world.

    Meshes: ``mesh`` has axes ``("dp", "ring", "ulysses")``; ``sp_mesh`` is
    ``mesh["ring", "ulysses"]`` flattened to ``"sp"`` and ``dp_sp_mesh`` the whole mesh
    flattened to ``"dp_sp"`` (the axis FSDP2 shards parameters over).

    ``node`` and ``local_rank`` are where the launcher really put this rank (``launch``
    holds what was observed; None when the nodes were emulated).

    Lifecycle: ``destroy()`` (or leaving a ``with topo:`` block) synchronises all ranks,
    then destroys the groups. Afterwards every group and mesh attribute raises
    :class:`TopologyDestroyedError`; degrees, coordinates and ``comm_stats`` stay readable.
    """

    rank_map: RankMap
    rank: int
    device_type: str
    _mesh: DeviceMesh = field(repr=False)
    _sp_mesh: DeviceMesh = field(repr=False)
    _dp_sp_mesh: DeviceMesh = field(repr=False)
    _groups: dict[str, dist.ProcessGroup] = field(repr=False)
    comm_stats: CommStats = field(default_factory=CommStats)
    launch: Launch | None = None
    _destroyed: bool = field(default=False, repr=False)

    # ------------------------------------------------------------------ groups and meshes
    def _live(self, what: str, value):
        if self._destroyed:
            raise TopologyDestroyedError(
                f"{what} of this Topology ({self.rank_map.describe()}) is no longer usable: "
                "the topology was destroyed (Topology.destroy() or the end of its `with` "
                "block). Build a new topology to communicate again."
            )
        return value

    @property
    def ulysses_group(self) -> dist.ProcessGroup:
        return self._live("ulysses_group", self._groups["ulysses"])

    @property
    def ring_group(self) -> dist.ProcessGroup:
        return self._live("ring_group", self._groups["ring"])

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._live("dp_group", self._groups["dp"])

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self._live("sp_group", self._groups["sp"])

    @property
    def dp_sp_group(self) -> dist.ProcessGroup:
        return self._live("dp_sp_group", self._groups["dp_sp"])

    @property
    def mesh(self) -> DeviceMesh:
        return self._live("mesh", self._mesh)

    @property
    def sp_mesh(self) -> DeviceMesh:
        return self._live("sp_mesh", self._sp_mesh)

    @property
    def dp_sp_mesh(self) -> DeviceMesh:
        return self._live("dp_sp_mesh", self._dp_sp_mesh)

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    # ------------------------------------------------------------------ degrees
    @property
    def ulysses_degree(self) -> int:
        return self.rank_map.ulysses_degree

    @property
    def ring_degree(self) -> int:
        return self.rank_map.ring_degree

    @property
    def sp_degree(self) -> int:
        return self.rank_map.sp_degree

    @property
    def dp_degree(self) -> int:
        return self.rank_map.dp_degree

    @property
    def world_size(self) -> int:
        return self.rank_map.world_size

    @property
    def placement(self) -> str:
        return self.rank_map.placement

    # ------------------------------------------------------------------ this rank
    @property
    def ulysses_rank(self) -> int:
        return self.rank_map.coords_of(self.rank).ulysses

    @property
    def ring_rank(self) -> int:
        return self.rank_map.coords_of(self.rank).ring

    @property
    def dp_rank(self) -> int:
        return self.rank_map.coords_of(self.rank).dp

    @property
    def sp_rank(self) -> int:
        return self.rank_map.sp_rank_of(self.rank)

    @property
    def node(self) -> int:
        return self.rank_map.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.rank_map.local_rank_of(self.rank)

    @property
    def ulysses_global_ranks(self) -> list[int]:
        """This rank's Ulysses group, indexed by ulysses rank (ascending)."""
        return self.rank_map.ulysses_group_of(self.rank)

    @property
    def ring_global_ranks(self) -> list[int]:
        """This rank's ring group, indexed by ring rank (ascending)."""
        return self.rank_map.ring_group_of(self.rank)

    @property
    def sp_global_ranks(self) -> list[int]:
        """This rank's sp group, indexed by ``sp_rank`` (not ascending for ring-in-node)."""
        return self.rank_map.sp_group_of(self.rank)

    @property
    def dp_global_ranks(self) -> list[int]:
        """This rank's dp group, indexed by dp rank (ascending)."""
        return self.rank_map.dp_group_of(self.rank)

    #: process groups exist (see :class:`usp.process_groups.single.SingleProcess`)
    single_process = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Topology:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.destroy()
        else:
            # Another rank may be blocked in a collective this rank will never join: a
            # barrier here could hang until the process-group timeout. Stop using the
            # groups and let the error end the job; the process exit releases them.
            self._destroyed = True

    def destroy(self) -> None:
        """Synchronise every rank, then destroy the groups this topology created.

        Collective when the topology is live: every rank must call it (a barrier over the
        default group comes first, and another after the groups are gone, so no rank
        closes connections another rank still reads, and a following
        ``dist.destroy_process_group()`` starts together everywhere). Idempotent. The
        WORLD group is never destroyed, even when an axis spans the whole world and torch
        reused it for that axis. Does nothing collective when the default group is
        already gone (its destruction took every group with it). Then the topology lets
        go of its groups and meshes: torch ends a group's threads only when its last
        reference goes (:mod:`usp.process_groups.shutdown`).
        """
        if self._destroyed:
            return
        self._destroyed = True
        if dist.is_initialized():
            self._barrier()
            world = dist.group.WORLD
            seen: set[int] = set()
            for group in self._groups.values():
                if group is None or group is world or id(group) in seen:
                    continue
                seen.add(id(group))
                dist.destroy_process_group(group)
            self._barrier()
        self._groups = dict.fromkeys(self._groups)  # the names stay, for the errors
        self._mesh = self._sp_mesh = self._dp_sp_mesh = None

    def _barrier(self) -> None:
        tensorless_barrier(self.device_type)  # why tensorless: see its docstring

    # ------------------------------------------------------------------ text
    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (node {self.node}, local {self.local_rank}): "
            f"dp {self.dp_rank}/{self.dp_degree}, ring {self.ring_rank}/{self.ring_degree}, "
            f"ulysses {self.ulysses_rank}/{self.ulysses_degree}, sp {self.sp_rank}/{self.sp_degree}; "
            f"{self.placement}, {self.rank_map.describe_nodes()}, {self.device_type}"
            + (" (destroyed)" if self._destroyed else "")
        )

    def __repr__(self) -> str:
        return f"Topology({self.describe()})"


def build_topology(
    ulysses_degree: int,
    ring_degree: int,
    *,
    dp_degree: int | None = None,
    ranks_per_node: int | None = None,
    device_type: str | None = None,
    placement: str = ULYSSES_IN_NODE,
    allow_cross_node_ulysses: bool = False,
    emulate_nodes: bool = False,
    timeout: timedelta | float | None = None,
) -> Topology:
    """Create the mesh and every group; call on all ranks after ``init_process_group``.

    Args:
        ulysses_degree, ring_degree: sizes of the Ulysses and ring axes.
        dp_degree: data-parallel replicas; ``None`` takes the rest of the world
            (an error when ``ring * ulysses`` does not divide the world size).
        ranks_per_node: ``None`` (default) takes the nodes the launcher started, observed
            from every rank's environment and host name. A number is checked against that
            launch: a mismatch is a :class:`TopologyError` naming both shapes.
        device_type: the DeviceMesh device type; ``None`` picks ``"cpu"`` for gloo or
            without CUDA and ``"cuda"`` otherwise (see :func:`default_device_type`).
        placement, allow_cross_node_ulysses: see :class:`RankMap`; "nodes" are the
            observed ones.
        emulate_nodes: pretend nodes of ``ranks_per_node`` consecutive ranks whatever the
            launch (tests and single-machine emulation of a cluster). Implied by the
            ``fake`` backend, which cannot observe anything; there ``ranks_per_node``
            defaults to ``LOCAL_WORLD_SIZE`` or the world size.
        timeout: how long any collective of the topology's groups (the DeviceMesh axes
            and the flattened ``sp``/``dp_sp`` groups, so FSDP's too) may wait for a peer
            before it fails (a ``timedelta`` or seconds); ``None`` takes the default
            group's timeout, as given to ``init_process_group`` (torch would otherwise give
            new groups its own default: 30 min on gloo, 10 min on NCCL). An axis that
            spans the whole world is torch's default group itself, whose timeout then
            becomes ``timeout`` too.

    Collective: every rank must call this with the same arguments. Every error (bad
    degrees, a launch that contradicts ``ranks_per_node``, Ulysses groups that would cross
    nodes) is raised on every rank before any group is created.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_topology needs torch.distributed.init_process_group first")
    device_type = device_type or default_device_type()
    world_size = dist.get_world_size()
    dp = _rest_of_world(world_size, ulysses_degree, ring_degree) if dp_degree is None else dp_degree
    degrees = dict(
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        dp_degree=dp,
        placement=placement,
        allow_cross_node_ulysses=allow_cross_node_ulysses,
    )
    launch = None
    if emulate_nodes or not can_observe_launch():
        if emulate_nodes and ranks_per_node is None:
            raise TopologyError("emulate_nodes=True needs ranks_per_node (the emulated node size)")
        rpn = default_ranks_per_node(world_size) if ranks_per_node is None else ranks_per_node
        rank_map = RankMap(world_size=world_size, ranks_per_node=rpn, **degrees)
    else:
        launch = observe_launch(device_type)
        if ranks_per_node is not None:
            check_launch_matches(ranks_per_node, launch)
        rank_map = RankMap.from_nodes(launch.node_of_rank, **degrees)
    return topology_from_rank_map(rank_map, device_type, launch=launch, timeout=timeout)


def check_launch_matches(ranks_per_node: int, launch: Launch) -> None:
    """A declared node size must be the launch's (uniform) node size."""
    check_degree("ranks_per_node", ranks_per_node)
    if launch.uniform and launch.node_sizes[0] == ranks_per_node:
        return
    nodes, extra = divmod(launch.world_size, ranks_per_node)
    declared = (
        describe_uniform_nodes(nodes, ranks_per_node)
        if nodes and not extra
        else f"nodes of {ranks_per_node} ranks, which do not divide {launch.world_size} ranks"
    )
    raise TopologyError(
        f"ranks_per_node={ranks_per_node} says {declared}; {launch.launched()}. Leave "
        "ranks_per_node unset to use the launch's nodes, or pass emulate_nodes=True to "
        "pretend other nodes on purpose"
    )


def _rest_of_world(world_size: int, ulysses_degree: int, ring_degree: int) -> int:
    u = check_degree("ulysses_degree", ulysses_degree)
    r = check_degree("ring_degree", ring_degree)
    if world_size % (u * r) != 0:
        raise TopologyError(
            f"ring({r}) * ulysses({u}) = {r * u} does not divide world_size({world_size}), "
            "so dp_degree cannot take the rest of the world"
        )
    return world_size // (u * r)


def topology_from_rank_map(
    rank_map: RankMap,
    device_type: str,
    *,
    launch: Launch | None = None,
    timeout: timedelta | float | None = None,
) -> Topology:
    """Create the mesh and groups of a validated rank map (collective); ``timeout`` as
    in :func:`build_topology`."""
    if rank_map.world_size != dist.get_world_size():
        raise TopologyError(
            f"the rank map has world_size({rank_map.world_size}) but the running job has "
            f"{dist.get_world_size()} ranks"
        )
    wait = _collective_timeout(timeout, device_type)
    mesh_tensor = torch.tensor(rank_map.mesh_list(), dtype=torch.int)  # [d, r, u] -> global rank
    mesh = DeviceMesh(device_type, mesh_tensor, mesh_dim_names=MESH_AXES)
    # Flattened axes get torch's sorted member order: sp_group's rank is not sp_rank.
    sp_mesh = mesh["ring", "ulysses"]._flatten("sp")
    dp_sp_mesh = mesh["dp", "ring", "ulysses"]._flatten("dp_sp")
    groups = {
        "ulysses": mesh["ulysses"].get_group(),
        "ring": mesh["ring"].get_group(),
        "dp": mesh["dp"].get_group(),
        "sp": sp_mesh.get_group(),
        "dp_sp": dp_sp_mesh.get_group(),
    }
    if wait is not None:
        for group in groups.values():
            group.set_timeout(wait)
    return Topology(
        rank_map=rank_map,
        rank=dist.get_rank(),
        device_type=device_type,
        _mesh=mesh,
        _sp_mesh=sp_mesh,
        _dp_sp_mesh=dp_sp_mesh,
        _groups=groups,
        launch=launch,
    )


def _collective_timeout(timeout: timedelta | float | None, device_type: str) -> timedelta | None:
    """``timeout`` as a timedelta; for ``None`` the default group's own timeout (None when
    the backend does not say, e.g. the ``fake`` backend)."""
    if timeout is not None:
        wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        if wait.total_seconds() <= 0:
            raise TopologyError(f"timeout must be positive, got {timeout!r}")
        return wait
    if dist.get_backend() not in ("gloo", "nccl"):
        return None
    try:
        default = dist.distributed_c10d._get_default_group()
        return default._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError):  # torch keeps it private; without it: torch's default
        return None
