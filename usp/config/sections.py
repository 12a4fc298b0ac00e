"""The topology sections of a config file: ``[cluster]``, ``[parallel]``,
``[attention]`` and a topology-only ``[model]`` (head counts); the file format is in
:mod:`usp.config.schema`. Each validates its fields in ``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass

from usp.config.fields import check_bool, check_choice, check_int, is_number
from usp.config.toml import AUTO, toml_repr
from usp.errors import ConfigError
from usp.options import (
    BACKENDS,
    DEFAULT_TOKEN_PLACEMENT,
    LAYOUTS,
    LINEAR_BACKENDS,
    LINEAR_CONV_BACKENDS,
    RING_IMPLS,
    TOKEN_PLACEMENTS,
)
from usp.process_groups.rank_math import PLACEMENTS, ULYSSES_IN_NODE, describe_uniform_nodes


@dataclass(frozen=True)
class ClusterConfig:
    """``nodes`` and ``gpus_per_node`` (ranks per node); ``"auto"`` takes the launch's."""

    nodes: int | str
    gpus_per_node: int | str
    # for ``usp plan``'s step-time estimate: link bandwidths in GB/s per direction
    # ("auto": usp.planner.search.DEFAULT_INTRA_NODE_GBPS / DEFAULT_INTER_NODE_GBPS)
    intra_node_gbps: float | str = AUTO
    inter_node_gbps: float | str = AUTO
    # the accelerator's name, for ``usp plan``'s memory limit ("auto": H200)
    gpu: str = AUTO

    def __post_init__(self) -> None:
        check_int("cluster", "nodes", self.nodes, auto=True)
        check_int("cluster", "gpus_per_node", self.gpus_per_node, auto=True)
        for key in ("intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, key)
            if value != AUTO and not (is_number(value) and value > 0):
                raise ConfigError(
                    f'[cluster] {key} must be a number > 0 (GB/s) or "auto", got {toml_repr(value)}'
                )
        if not (isinstance(self.gpu, str) and self.gpu):
            raise ConfigError(
                f'[cluster] gpu must be a name such as "H200", got {toml_repr(self.gpu)}'
            )

    @property
    def is_auto(self) -> bool:
        return AUTO in (self.nodes, self.gpus_per_node)

    @property
    def world_size(self) -> int:
        """``nodes * gpus_per_node``; a :class:`ConfigError` when either is ``"auto"``."""
        if self.is_auto:
            raise ConfigError(
                f"[cluster] nodes = {toml_repr(self.nodes)}, gpus_per_node = "
                f"{toml_repr(self.gpus_per_node)}: the world size comes from the launch"
            )
        return self.nodes * self.gpus_per_node

    def describe(self) -> str:
        """``"1 node x 4 ranks"`` (``"auto"`` where the launch decides)."""
        return describe_uniform_nodes(self.nodes, self.gpus_per_node)


@dataclass(frozen=True)
class ParallelConfig:
    ulysses: int | str
    ring: int | str
    dp: int | str = AUTO
    placement: str = ULYSSES_IN_NODE
    allow_cross_node_ulysses: bool = False
    #: how a packed batch's documents go to the SP ranks (``usp.Plan``'s ``placement``;
    #: this name because ``placement`` already places the ranks on nodes)
    token_placement: str = DEFAULT_TOKEN_PLACEMENT

    def __post_init__(self) -> None:
        for key in ("ulysses", "ring", "dp"):
            check_int("parallel", key, getattr(self, key), auto=True)
        check_choice("parallel", "placement", self.placement, PLACEMENTS)
        check_bool("parallel", "allow_cross_node_ulysses", self.allow_cross_node_ulysses)
        check_choice("parallel", "token_placement", self.token_placement, TOKEN_PLACEMENTS)


@dataclass(frozen=True)
class AttentionConfig:
    """How tokens are mixed: the sequence layout, the ring, attention's kernel backend, and
    linear attention's kernels (Gated DeltaNet's recurrence and its short conv; models
    without such layers ignore them)."""

    layout: str = "zigzag"
    ring_impl: str = "p2p"
    backend: str = "auto"
    linear_backend: str = "auto"
    linear_conv_backend: str = "auto"

    def __post_init__(self) -> None:
        check_choice("attention", "layout", self.layout, LAYOUTS)
        check_choice("attention", "ring_impl", self.ring_impl, RING_IMPLS)
        check_choice("attention", "backend", self.backend, BACKENDS)
        check_choice("attention", "linear_backend", self.linear_backend, LINEAR_BACKENDS)
        check_choice(
            "attention", "linear_conv_backend", self.linear_conv_backend, LINEAR_CONV_BACKENDS
        )


@dataclass(frozen=True)
class ModelConfig:
    """A topology config's ``[model]``: the head counts the Ulysses degree must split."""

    num_heads: int
    num_kv_heads: int | None = None  # None: same as num_heads (multi-head attention)
    head_dim: int | None = None  # only used for byte estimates

    def __post_init__(self) -> None:
        check_int("model", "num_heads", self.num_heads)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        check_int("model", "num_kv_heads", self.num_kv_heads)
        if self.head_dim is not None:
            check_int("model", "head_dim", self.head_dim)
        if self.num_heads % self.num_kv_heads != 0:
            raise ConfigError(
                f"[model] num_heads({self.num_heads}) is not a multiple of "
                f"num_kv_heads({self.num_kv_heads})"
            )
