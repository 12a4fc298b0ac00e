"""Process groups for hybrid sequence parallelism, all owned by one :class:`Topology`.

One ``DeviceMesh`` with axes ``("dp", "ring", "ulysses")`` is built from the pure
:class:`~usp.process_groups.rank_math.RankMap`; every process group comes from that mesh
(its axes and two flattened axes), so there is exactly one owner and no global state.
Whatever needs groups (attention, sharding, loss, FSDP) receives the ``Topology``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from usp.comm.stats import CommStats
from usp.process_groups.rank_math import ULYSSES_IN_NODE, RankMap, TopologyError, check_degree

MESH_AXES = ("dp", "ring", "ulysses")


def default_ranks_per_node(world_size: int, environ: dict[str, str] | None = None) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE``, or ``world_size`` (one node) when it is not set."""
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
    """

    rank_map: RankMap
    rank: int
    device_type: str
    mesh: DeviceMesh
    sp_mesh: DeviceMesh
    dp_sp_mesh: DeviceMesh
    ulysses_group: dist.ProcessGroup
    ring_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    sp_group: dist.ProcessGroup
    dp_sp_group: dist.ProcessGroup
    comm_stats: CommStats = field(default_factory=CommStats)
    _destroyed: bool = field(default=False, repr=False)

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

    # ------------------------------------------------------------------ lifecycle
    def destroy(self) -> None:
        """Destroy the sub-groups this topology created (best effort; idempotent).

        The WORLD group is never destroyed, even when an axis spans the whole world and
        torch reused it for that axis; ranks outside a group have nothing to destroy.
        After this the groups and meshes must not be used.
        """
        if self._destroyed:
            return
        world = dist.group.WORLD
        seen: set[int] = set()
        for group in (
            self.ulysses_group,
            self.ring_group,
            self.dp_group,
            self.sp_group,
            self.dp_sp_group,
        ):
            if group is None or group is world or id(group) in seen:
                continue
            seen.add(id(group))
            dist.destroy_process_group(group)
        self._destroyed = True

    # ------------------------------------------------------------------ text
    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} (node {self.node}, local {self.local_rank}): "
            f"dp {self.dp_rank}/{self.dp_degree}, ring {self.ring_rank}/{self.ring_degree}, "
            f"ulysses {self.ulysses_rank}/{self.ulysses_degree}, sp {self.sp_rank}/{self.sp_degree}; "
            f"{self.placement}, {self.rank_map.ranks_per_node} ranks/node, {self.device_type}"
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
) -> Topology:
    """Create the mesh and every group; call on all ranks after ``init_process_group``.

    Args:
        ulysses_degree, ring_degree: sizes of the Ulysses and ring axes.
        dp_degree: data-parallel replicas; ``None`` takes the rest of the world
            (an error when ``ring * ulysses`` does not divide the world size).
        ranks_per_node: defaults to torchrun's ``LOCAL_WORLD_SIZE`` environment variable,
            and to the world size (a single node) when that is not set.
        device_type: the DeviceMesh device type; ``None`` picks ``"cpu"`` for gloo or
            without CUDA and ``"cuda"`` otherwise (see :func:`default_device_type`).
        placement, allow_cross_node_ulysses: see :class:`RankMap`.

    Group creation is collective: every rank must call this with the same arguments.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_topology needs torch.distributed.init_process_group first")
    world_size = dist.get_world_size()
    rank_map = RankMap(
        world_size=world_size,
        ranks_per_node=default_ranks_per_node(world_size)
        if ranks_per_node is None
        else ranks_per_node,
        ulysses_degree=ulysses_degree,
        ring_degree=ring_degree,
        dp_degree=_rest_of_world(world_size, ulysses_degree, ring_degree)
        if dp_degree is None
        else dp_degree,
        placement=placement,
        allow_cross_node_ulysses=allow_cross_node_ulysses,
    )
    return _topology_from_rank_map(rank_map, device_type or default_device_type())


def _rest_of_world(world_size: int, ulysses_degree: int, ring_degree: int) -> int:
    u = check_degree("ulysses_degree", ulysses_degree)
    r = check_degree("ring_degree", ring_degree)
    if world_size % (u * r) != 0:
        raise TopologyError(
            f"ring({r}) * ulysses({u}) = {r * u} does not divide world_size({world_size}), "
            "so dp_degree cannot take the rest of the world"
        )
    return world_size // (u * r)


def _topology_from_rank_map(rank_map: RankMap, device_type: str) -> Topology:
    mesh_tensor = torch.tensor(rank_map.mesh_list(), dtype=torch.int)  # [d, r, u] -> global rank
    mesh = DeviceMesh(device_type, mesh_tensor, mesh_dim_names=MESH_AXES)
    # Flattened axes get torch's sorted member order: sp_group's rank is not sp_rank.
    sp_mesh = mesh["ring", "ulysses"]._flatten("sp")
    dp_sp_mesh = mesh["dp", "ring", "ulysses"]._flatten("dp_sp")
    return Topology(
        rank_map=rank_map,
        rank=dist.get_rank(),
        device_type=device_type,
        mesh=mesh,
        sp_mesh=sp_mesh,
        dp_sp_mesh=dp_sp_mesh,
        ulysses_group=mesh["ulysses"].get_group(),
        ring_group=mesh["ring"].get_group(),
        dp_group=mesh["dp"].get_group(),
        sp_group=sp_mesh.get_group(),
        dp_sp_group=dp_sp_mesh.get_group(),
    )
