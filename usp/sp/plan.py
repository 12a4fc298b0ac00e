"""The plan: one owner of how a sequence is placed on the SP ranks and attended.

A :class:`Plan` carries the :class:`~usp.process_groups.Topology` and the attention
choices (sequence layout, ring implementation, kernel backend; linear attention's
kernels). Sharding, position ids, gathering, attention and Gated DeltaNet layers all read
them from the plan, so they cannot disagree::

    plan = usp.Plan.from_config("examples/configs/cpu_demo.toml")   # or usp.Plan(topology)
    ids = plan.shard(input_ids)                  # [B, S] -> [B, S/P]
    pos = plan.position_ids(input_ids.shape[1])  # RoPE positions of this rank's tokens
    out = plan.attention(q, k, v, causal=True)   # inside the attention layer

Packed documents are validated once per batch with :meth:`Plan.pack` (a collective: the
SP ranks agree on the boundaries), which also builds every device tensor the kernels
need; pass the :class:`PackedSequence` down to the layers, and nothing inside a layer
syncs with the host. ``Plan(None)`` is the single-process plan: the same calls, no
communication (what a model uses without sequence parallelism); its tokens stay in
their natural order (the layout is always ``contiguous`` there).
"""

from __future__ import annotations

import os
import weakref

import torch

from usp.comm.agreement import Field, agree, can_agree
from usp.comm.call_check import documents_field  # noqa: F401 - re-exported here
from usp.comm.traced import TracedGroup
from usp.config import UspConfig, build_topology_from_config, check_topology_matches, load_config
from usp.kernels.backends.registry import KernelRegistry
from usp.options import (
    BACKENDS,
    DEFAULT_BACKEND,
    DEFAULT_LAYOUT,
    DEFAULT_LINEAR_BACKEND,
    DEFAULT_LINEAR_CONV_BACKEND,
    DEFAULT_RING_IMPL,
    DEFAULT_TOKEN_PLACEMENT,
    LAYOUTS,
    LINEAR_BACKENDS,
    LINEAR_CONV_BACKENDS,
    RING_IMPLS,
    TOKEN_PLACEMENTS,
    check_choice,
)
from usp.process_groups import SingleProcess, Topology, as_topology
from usp.sp.assignment import DocumentCost
from usp.sp.attend import TraceCache, attend
from usp.sp.packing import (
    PackedSequence,
    PlanError,
    dtype_id,
    show_dtype_id,
)
from usp.sp.placed import (
    PlacedSequence,
    attend_placed,
    gather_placed,
)
from usp.sp.plan_packing import PlanPacking
from usp.sp.sharding import (
    gather_by_documents,
    rank_token_indices,
    required_multiple,
)


def _validated_choice(what: str, value, choices) -> str:
    return check_choice(what, value, choices, PlanError)


__all__ = ["PackedSequence", "PlacedSequence", "Plan", "PlanError", "as_plan"]


class Plan(PlanPacking):
    """The topology plus the attention choices; see the module docstring."""

    def __init__(
        self,
        topology: Topology | None,
        *,
        layout: str = DEFAULT_LAYOUT,
        ring_impl: str = DEFAULT_RING_IMPL,
        backend: str = DEFAULT_BACKEND,
        verify_calls: bool | None = None,
        kernel_registry: KernelRegistry | None = None,
        linear_backend: str = DEFAULT_LINEAR_BACKEND,
        linear_conv_backend: str = DEFAULT_LINEAR_CONV_BACKEND,
        placement: str = DEFAULT_TOKEN_PLACEMENT,
        placement_cost: DocumentCost | None = None,
    ):
        """``placement``: how a packed sequence's documents go to the SP ranks:
        ``"sequence"`` splits every document over the group; ``"documents"`` computes
        short documents whole on one rank and splits only those whose work a rank
        cannot balance (:mod:`usp.sp.placed`; a dense sequence is split either way).
        ``placement_cost``: the :class:`~usp.sp.assignment.DocumentCost` that
        ``"documents"`` balances (None: a Llama-3-8B-like model's;
        :func:`usp.models.document_cost` gives a model's). ``linear_backend`` / ``linear_conv_backend``: the kernels of the Gated DeltaNet
        layers computed under this plan that leave the choice to it (``kernel=None`` /
        ``conv_kernel=None``, the default of :class:`usp.linear.GatedDeltaNet` and
        :func:`usp.linear.gated_deltanet_usp`): ``"auto"``, ``"torch"`` or ``"fla"``, and
        ``"auto"``, ``"torch"`` or ``"causal_conv1d"``. ``verify_calls``: agree across
        the SP ranks on every attention call before it communicates (None: on for gloo,
        off for NCCL where it costs a host sync per layer; see
        :mod:`usp.comm.call_check`). ``kernel_registry``: where the attention
        calls look their backends up (None: usp's,
        :data:`usp.kernels.backends.registry.DEFAULT`); the planner passes one holding
        its fake-tensor stand-ins. Eager calls only: a compiled graph's kernel ops use
        usp's registry, so a plan with its own refuses ``torch.compile``."""
        topology = as_topology(topology)
        if not isinstance(topology, (Topology, SingleProcess)):
            raise PlanError(
                f"Plan needs a usp.process_groups.Topology (or None for one process), got "
                f"{type(topology).__name__}"
            )
        #: a Topology, or :data:`~usp.process_groups.SINGLE_PROCESS` (``Plan(None)``)
        self.topology = topology
        self.layout = _validated_choice("sequence layout", layout, LAYOUTS)
        self.placement = _validated_choice("placement", placement, TOKEN_PLACEMENTS)
        if placement_cost is not None and not isinstance(placement_cost, DocumentCost):
            raise PlanError(
                "placement_cost must be None or a usp.sp.assignment.DocumentCost, got "
                f"{type(placement_cost).__name__}"
            )
        self.placement_cost = DocumentCost() if placement_cost is None else placement_cost
        if topology.single_process:
            # one process has nothing to balance: tokens stay in their natural order
            self.layout = "contiguous"
            self.placement = DEFAULT_TOKEN_PLACEMENT
        self.ring_impl = _validated_choice("ring_impl", ring_impl, RING_IMPLS)
        self.backend = _validated_choice("attention backend", backend, BACKENDS)
        self.linear_backend = _validated_choice("linear_backend", linear_backend, LINEAR_BACKENDS)
        self.linear_conv_backend = _validated_choice(
            "linear_conv_backend", linear_conv_backend, LINEAR_CONV_BACKENDS
        )
        if verify_calls is not None and not isinstance(verify_calls, bool):
            raise PlanError(f"verify_calls must be None, True or False, got {verify_calls!r}")
        self.verify_calls = verify_calls
        if kernel_registry is not None and not isinstance(kernel_registry, KernelRegistry):
            raise PlanError(
                "kernel_registry must be None or a usp.kernels.backends.registry."
                f"KernelRegistry, got {type(kernel_registry).__name__}"
            )
        self.kernel_registry = kernel_registry
        #: the checked calls of compiled graphs (see :func:`usp.sp.attend.traced_call`)
        self.traced_calls = TraceCache()
        #: the SP group as a compiled graph's collectives take it (None: one process)
        self.traced_sp_group = None
        if topology.sp_degree > 1:
            self.traced_sp_group = TracedGroup.of(topology.sp_group)
        #: placement="documents": this plan placing by sequence (what attends to the
        #: split documents) and the one-process plan that computes a rank's whole
        #: documents (this plan's kernels, no communication); None otherwise
        self.split_plan = self.whole_plan = None
        if self.placement == "documents":
            self.split_plan = self.with_options(placement="sequence")
            self.whole_plan = Plan(
                None, backend=backend, kernel_registry=kernel_registry,
                linear_backend=linear_backend, linear_conv_backend=linear_conv_backend,
            )  # fmt: skip

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(
        cls,
        config_or_path,
        /,
        *,
        topology: Topology | None | str = "build",
        verify_calls: bool | None = None,
        device_type: str | None = None,
        **overrides,
    ) -> Plan:
        """The plan a config describes: its ``[attention]`` choices on its topology. The
        one way a config becomes a Plan (the CLI, the trainer, the examples and the tests
        all come here).

        ``config_or_path``: a :class:`~usp.config.UspConfig` or a topology config's path;
        ``overrides`` replace its keys (``ulysses=4``, ``layout="contiguous"``, ...).
        ``topology``: ``"build"`` builds it from the config after ``init_process_group``
        (a collective: every rank calls it); a Topology built already is used once the
        degrees the config gives as numbers match it; None: the single-process plan.
        ``verify_calls`` as in :class:`Plan` (None: on for gloo, off for NCCL).
        """
        if isinstance(config_or_path, UspConfig):
            config = config_or_path.with_overrides(**overrides) if overrides else config_or_path
        else:
            config = load_config(os.fspath(config_or_path), **overrides)
        if isinstance(topology, str):
            if topology != "build":
                raise PlanError(
                    f'topology must be "build", a usp.process_groups.Topology or None, got {topology!r}'
                )
            topology = build_topology_from_config(config, device_type=device_type)
        elif isinstance(topology, Topology):
            check_topology_matches(config, topology)
        a = config.attention
        return cls(
            topology,
            placement=config.parallel.token_placement,
            layout=a.layout,
            ring_impl=a.ring_impl,
            backend=a.backend,
            verify_calls=verify_calls,
            linear_backend=a.linear_backend,
            linear_conv_backend=a.linear_conv_backend,
        )

    def with_options(
        self,
        *,
        layout: str | None = None,
        ring_impl: str | None = None,
        backend: str | None = None,
        linear_backend: str | None = None,
        linear_conv_backend: str | None = None,
        placement: str | None = None,
        placement_cost: DocumentCost | None = None,
    ) -> Plan:
        """The same topology with some choices replaced (None keeps this plan's)."""
        given = (layout, ring_impl, backend, linear_backend, linear_conv_backend, placement,
                 placement_cost)  # fmt: skip
        if all(choice is None for choice in given):
            return self
        return Plan(
            self.topology,
            layout=self.layout if layout is None else layout,
            ring_impl=self.ring_impl if ring_impl is None else ring_impl,
            backend=self.backend if backend is None else backend,
            verify_calls=self.verify_calls,
            kernel_registry=self.kernel_registry,
            linear_backend=self.linear_backend if linear_backend is None else linear_backend,
            linear_conv_backend=(
                self.linear_conv_backend if linear_conv_backend is None else linear_conv_backend
            ),
            placement=self.placement if placement is None else placement,
            placement_cost=self.placement_cost if placement_cost is None else placement_cost,
        )

    @classmethod
    def lasting(cls, topology, layout, ring_impl, backend, verify_calls) -> Plan:
        """The Plan of these choices that outlives a compiled graph's trace (kept per
        topology): a plan made while Dynamo traces exists only in the trace, and the
        checked calls of compiled graphs are kept by a plan (``traced_calls``)."""
        plans = _LASTING.setdefault(as_topology(topology), {})
        key = (layout, ring_impl, backend, verify_calls)
        if key not in plans:
            plans[key] = cls(
                topology, layout=layout, ring_impl=ring_impl, backend=backend,
                verify_calls=verify_calls,
            )  # fmt: skip
        return plans[key]

    # ------------------------------------------------------------------ degrees and groups
    @property
    def ulysses_degree(self) -> int:
        return self.topology.ulysses_degree

    @property
    def ring_degree(self) -> int:
        return self.topology.ring_degree

    @property
    def sp_degree(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def ring_rank(self) -> int:
        return self.topology.ring_rank

    @property
    def ulysses_rank(self) -> int:
        return self.topology.ulysses_rank

    @property
    def sp_group(self):
        """The SP ranks' process group (None for a single process)."""
        return self.topology.sp_group

    @property
    def ring_group(self):
        return self.topology.ring_group

    @property
    def ulysses_group(self):
        return self.topology.ulysses_group

    @property
    def comm_stats(self):
        return self.topology.comm_stats

    @property
    def sequence_multiple(self) -> int:
        """A dense global sequence length must be a multiple of this."""
        return required_multiple(self.ring_degree, self.ulysses_degree, self.layout)

    def default_device(self) -> torch.device:
        if self.topology.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ------------------------------------------------------------------ sharding
    def token_indices(self, seq_len: int, *, packed=None, device=None) -> torch.Tensor:
        """Indices into the global sequence of the tokens this rank holds, in local order
        (int64 [S/P])."""
        if self.topology.single_process and packed is None:  # dense: natural order
            return torch.arange(seq_len, device=device)
        placed = self._placed(seq_len, packed)
        if placed is not None:
            return placed.token_indices.to(device)
        if isinstance(packed, PackedSequence):  # worked out when it was packed
            return self.packed_sequence(packed, seq_len=seq_len).token_indices.to(device)
        documents = self._documents(seq_len, packed)
        return rank_token_indices(
            documents, self.ring_rank, self.ulysses_degree, self.ulysses_rank
        ).to(device)

    def position_ids(self, seq_len: int, *, packed=None, device=None) -> torch.Tensor:
        """RoPE positions of this rank's tokens, in local order (int64 [S/P]): their global
        positions, or with packed documents their positions inside each document."""
        indices = self.token_indices(seq_len, packed=packed)
        if packed is None:
            return indices.to(device)
        if not isinstance(packed, (PackedSequence, PlacedSequence)):
            packed = self.pack(packed, agree_ranks=False, seq_len=seq_len)
        return packed.position_ids[indices].to(device)

    def shard(self, x: torch.Tensor, *, dim: int = 1, packed=None) -> torch.Tensor:
        """This rank's shard of ``x`` (the global sequence along ``dim``, identical on every
        SP rank). Differentiable (an index_select)."""
        dim = dim % x.dim()
        return x.index_select(dim, self.token_indices(x.shape[dim], packed=packed, device=x.device))

    def gather(self, x_local: torch.Tensor, *, dim: int = 1, packed=None) -> torch.Tensor:
        """The inverse of :meth:`shard`: the global sequence, on every SP rank. A
        collective over the SP group; the result carries no gradient."""
        dim = dim % x_local.dim()
        if packed is not None and self.placement == "documents":  # ranks hold different counts
            return gather_placed(x_local, self, self.shard_packing(packed, x_local.shape[dim]), dim)
        documents = self._documents(x_local.shape[dim] * self.sp_degree, packed)
        if self.topology.single_process:  # packed documents are still reordered on a ring of one
            indices = rank_token_indices(documents, 0, 1, 0).to(x_local.device)
            return torch.empty_like(x_local).index_copy(dim, indices, x_local.detach())
        return gather_by_documents(x_local, self.topology, documents, dim)

    # ------------------------------------------------------------------ attention
    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = False,
        softmax_scale: float | None = None,
        packed=None,
        verify: bool | None = None,
        head_chunks: int = 1,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        partial: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Exact attention over the global sequence: q [B, S/P, H, D], k/v
        [B, S/P, Hkv, D] (this rank's shard, after RoPE) -> [B, S/P, H, D], in q's dtype.
        ``packed``: a :class:`PackedSequence` (or global cu_seqlens) for block-diagonal
        attention by document. ``head_chunks``: see :func:`usp.sp.attend.attend`. ``window``,
        ``sinks``: see :func:`usp.usp_attention`. ``partial``: (out [B, S/P, H, Dv], lse
        [B, S/P, H]) of more keys per row, computed by the caller, merged in (eagerly;
        :mod:`usp.ring.partial`: Gemma 3's image blocks)."""
        if self.kernel_registry is not None and torch.compiler.is_compiling():
            raise PlanError(
                "a Plan with its own kernel_registry cannot run under torch.compile (the "
                "compiled kernel ops use usp's registry); call it eagerly"
            )
        verify = self.verify_calls if verify is None else verify
        if self.placement == "documents" and packed is not None:
            if partial is not None:  # a plan option: the same refusal on every rank
                raise PlanError(
                    "partial= (a partial result merged into the ring) is computed for "
                    "placement='sequence' plans only; build the plan without "
                    "placement='documents' to merge one"
                )
            return attend_placed(
                self, q, k, v, causal=causal, softmax_scale=softmax_scale, packed=packed,
                verify=verify, head_chunks=head_chunks, window=window, sinks=sinks,
            )  # fmt: skip
        return attend(
            self, q, k, v, causal=causal, softmax_scale=softmax_scale, packed=packed,
            verify=verify, head_chunks=head_chunks, window=window, sinks=sinks,
            partial=partial,
        )  # fmt: skip

    def verify_batch(self, *tensors: torch.Tensor, packed=None) -> None:
        """Agree across the SP ranks on a batch's shapes and dtypes (and documents) once
        per step — the cheap alternative to per-call checks on NCCL. A collective."""
        group = self.sp_group
        if group is None or self.sp_degree == 1 or not can_agree(group):
            return
        fields = []
        for i, t in enumerate(tensors):
            shape = list(t.shape)[:4] + [-1] * (4 - min(t.dim(), 4))
            fields += [Field(f"tensor {i} shape[{d}]", n) for d, n in enumerate(shape)]
            fields.append(Field(f"tensor {i} dtype", dtype_id(t.dtype), show_dtype_id))
        if packed is not None:
            fields.append(documents_field(self.packed_sequence(packed).bounds, "cu_seqlens"))
        agree(group, "Plan.verify_batch", fields)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Plan:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving a ``with`` block tears the topology down as ``with topology:`` does."""
        self.topology.__exit__(exc_type, exc, tb)

    # ------------------------------------------------------------------ text
    def describe(self) -> str:
        text = f"{self.topology.describe()}; layout={self.layout}, ring_impl={self.ring_impl}, backend={self.backend}"
        linear = {"linear_backend": (self.linear_backend, DEFAULT_LINEAR_BACKEND),
                  "linear_conv_backend": (self.linear_conv_backend, DEFAULT_LINEAR_CONV_BACKEND)}  # fmt: skip
        linear["placement"] = (self.placement, DEFAULT_TOKEN_PLACEMENT)
        for name, (chosen, default) in linear.items():  # named when chosen
            if chosen != default:
                text += f", {name}={chosen}"
        return text

    def __repr__(self) -> str:
        return f"Plan({self.describe()})"


def as_plan(topology_or_plan, **attention_options) -> Plan:
    """A :class:`Plan` from a Plan, a Topology (default choices) or None (one process);
    ``attention_options`` (``layout``, ``ring_impl``, ``backend``, ``linear_backend``,
    ``linear_conv_backend``; None keeps the plan's) replace the choices."""
    if isinstance(topology_or_plan, Plan):
        return topology_or_plan.with_options(**attention_options)
    if topology_or_plan is None or isinstance(topology_or_plan, (Topology, SingleProcess)):
        return Plan(topology_or_plan).with_options(**attention_options)
    raise TypeError(
        "expected a usp.process_groups.Topology, a usp.Plan or None (single process), "
        f"got {type(topology_or_plan).__name__}"
    )


#: the lasting plans of compiled graphs (:meth:`Plan.lasting`), by topology and choices
_LASTING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
