"""A token-local mixture-of-experts block (Qwen3-MoE's routing), its router statistics
and the load-balancing loss, exact under sequence parallelism.

* :class:`Router` (HF's ``mlp.gate``): logits ``x W^T`` [N, E], a softmax in float32 (or
  wider: float64 stays float64), the top-k experts of each token and their weights
  (renormalised to sum to 1 with ``norm_topk_prob``), cast back to the input's dtype.
* :class:`Experts` (HF's ``mlp.experts``): grouped weights ``gate_up_proj`` [E, 2I, H] and
  ``down_proj`` [E, H, I], the parameter names and layout transformers 5 keeps in memory
  (checkpoints hold one tensor per expert: :mod:`usp.models.moe_keys`). The forward sorts the (token, expert) pairs by expert
  once, gathers the routed rows into one ``[N*k, H]`` buffer and runs every expert on its
  contiguous segment: one ``torch._grouped_mm`` per projection where torch offers it for
  the dtype and device (no host sync), else one matmul per expert over its segment (one
  host sync for the segment sizes). The weighted rows are added back per token with one
  ``index_add`` (:func:`usp.models.moe_op.routed_experts`; under ``torch.compile`` that
  data-dependent part is one op, ``usp::moe_experts``, with fixed shapes).
  :func:`experts_loop` is the per-expert reference (transformers' scheme).
* :class:`SparseMoE` (HF's ``Qwen3MoeSparseMoeBlock``): router + experts, the decoder
  layer's ``mlp``; with ``shared_expert=`` (HF's ``Qwen2MoeSparseMoeBlock`` and
  ``Qwen3_5MoeSparseMoeBlock``) a dense MLP every token also runs, scaled per token by
  ``sigmoid(shared_expert_gate(x))`` and added to the routed experts' sum. Every token
  stays on its rank (no expert parallelism): under SP the block needs no communication.
  Expert parallelism would replace the gather/scatter of :meth:`Experts.forward` by an
  all-to-all of the sorted rows over an expert axis, behind the same module.
* With ``mlp_tile_tokens`` (:attr:`Experts.tile_tokens`) the routed rows run a tile of
  tokens at a time, each tile recomputed in backward (:func:`usp.models.moe_op.tiled_experts`).
* A family whose router or experts differ (:mod:`usp.models.gpt_oss_experts`: a router with bias,
  experts with biases and another activation, kept in transformers' layout) subclasses
  :class:`SparseMoE` (:meth:`SparseMoE.route`) and :class:`Experts`
  (its :attr:`Experts.kind`, an expert function registered with
  :func:`usp.models.moe_op.register_experts_kind`, :meth:`Experts.op_params` and
  :meth:`Experts.op_options`; :attr:`Experts.per_expert_checkpoint` False when its
  checkpoints hold the grouped tensors): the sorting, statistics and aux loss are shared.

The load-balancing loss (Switch Transformer, as transformers' ``load_balancing_loss_func``
computes it without an attention mask) is ``E * sum_e f_e * p_e`` with ``f_e`` the share
of top-k assignments to expert ``e`` and ``p_e`` its mean router probability, both over
every token of the batch and every MoE layer. Both are sums over tokens: each rank sums
its own tokens' (:func:`router_stats`: each :class:`SparseMoE` returns its layer's
as a tensor beside its output, the decoder stack adds them up and the causal LM turns
them into the aux term it returns with the loss) and :func:`sp_router_aux_loss` sums
them over the SP group in one ``all_reduce`` before dividing. Its value is then the same on every rank and its
gradient is this rank's share (the SUM over the SP group of the gradients is one
process's), as :func:`usp.models.loss.sp_normalise` does for the cross-entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from usp.compile_marks import constant_result
from usp.models.moe_op import moe_experts, register_experts_kind, routed_experts, tiled_experts
from usp.models.moe_planning import planned, planned_segments


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Router probabilities and statistics: float32 at least (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------- the router
class Router(nn.Module):
    """Top-k softmax routing: ``x`` [N, H] -> (probabilities [N, E] in :func:`stats_dtype`,
    top-k weights [N, k] in ``x``'s dtype, top-k expert indices [N, k])."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight)  # [N, E]
        probs = torch.softmax(logits.to(stats_dtype(logits.dtype)), dim=-1)  # [N, E]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), experts

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        self.weight.normal_(0.0, std, generator=generator)

    def matmul_parameters(self) -> int:
        return self.weight.numel()


# ---------------------------------------------------------------------- the experts
class Experts(nn.Module):
    """``E`` SwiGLU experts as grouped weights; ``forward(x [N, H], experts [N, k], weights
    [N, k]) -> [N, H]``: each token's weighted sum of its experts' outputs."""

    #: checkpoints hold one tensor per expert (Qwen3-MoE); False: the grouped tensors
    #: under the parameters' own names (gpt-oss)
    per_expert_checkpoint: bool = True
    #: tokens per tile of routed rows (a lever, set by usp.models.Levers' mlp_tile_tokens
    #: on the instance); 0: untiled
    tile_tokens: int = 0

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        #: None: grouped GEMM where torch has one for the dtype and device; False: never
        self.grouped_gemm: bool | None = None

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator | None = None) -> None:
        self.gate_up_proj.normal_(0.0, std, generator=generator)
        self.down_proj.normal_(0.0, std, generator=generator)

    def matmul_parameters(self) -> int:
        """Parameters one token multiplies by (its ``top_k`` experts'), for FLOP counts."""
        return self.top_k * (self.gate_up_proj[0].numel() + self.down_proj[0].numel())

    #: the expert function the routed rows run (:func:`usp.models.moe_op.register_experts_kind`)
    kind = "swiglu"

    def op_params(self) -> list[torch.Tensor]:
        """The grouped weights the expert function takes, in its order."""
        return [self.gate_up_proj, self.down_proj]

    def op_options(self) -> list[float]:
        """The expert function's float settings (none for SwiGLU)."""
        return []

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """x [N, H], experts [N, k], weights [N, k] -> [N, H] (:func:`routed_experts`);
        with :attr:`tile_tokens`, over tiles of that many tokens, each recomputed in
        backward (:func:`usp.models.moe_op.tiled_experts`); compiled, one
        ``usp::moe_experts`` op (:mod:`usp.models.moe_op`): the segment sizes depend on
        the routing, which a static graph cannot hold."""
        args = (x, experts, weights, self.op_params(), self.kind, self.op_options())
        if torch.compiler.is_compiling():
            grouped = self.grouped_gemm is not False and _grouped_on(x)
            return moe_experts(*args, grouped, self.tile_tokens)
        if self.tile_tokens and x.shape[0] > self.tile_tokens:
            return tiled_experts(*args, self._use_grouped_gemm(x), self.tile_tokens)
        return routed_experts(*args, self._use_grouped_gemm(x))

    def _use_grouped_gemm(self, x: torch.Tensor) -> bool:
        if self.grouped_gemm is False or is_fake(x):
            return False
        return grouped_gemm_available(x.dtype, x.device)


@constant_result
def _grouped_on(x: torch.Tensor) -> bool:
    """:func:`grouped_gemm_available` for ``x`` while a graph is traced (a constant of
    the graph: the device's capability is read once, eagerly)."""
    return grouped_gemm_available(x.dtype, x.device)


def grouped_gemm_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs for ``dtype`` on ``device`` (float32 and bf16
    on CPU in torch 2.13; bf16 on Hopper; never float64)."""
    if not hasattr(torch, "_grouped_mm") or dtype not in (torch.float32, torch.bfloat16):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return device.type == "cpu"


def _swiglu_halves(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _run_swiglu(rows, counts, row_experts, params, options, grouped) -> torch.Tensor:
    """rows [M, H] sorted by expert, counts [E] -> [M, H]: the SwiGLU experts
    (``params``: gate_up_proj [E, 2I, H], down_proj [E, H, I]) on their segments."""
    gate_up_proj, down_proj = params
    if grouped:
        return _grouped_swiglu(rows, gate_up_proj, down_proj, counts)
    return _segment_swiglu(rows, gate_up_proj, down_proj, counts)


def _grouped_swiglu(rows, gate_up_proj, down_proj, counts) -> torch.Tensor:
    """rows [M, H] sorted by expert, counts [E] -> [M, H]: two grouped GEMMs."""
    offsets = counts.cumsum(0).to(torch.int32)  # [E] segment ends (no host sync)
    gate_up = torch._grouped_mm(rows, gate_up_proj.transpose(1, 2), offs=offsets)  # [M, 2I]
    return torch._grouped_mm(_swiglu_halves(gate_up), down_proj.transpose(1, 2), offs=offsets)


def segment_sizes(rows: torch.Tensor, counts: torch.Tensor) -> list[int]:
    """Each expert's rows (one host sync). Under fake tensors: in the planner the most
    uneven routing (:func:`usp.models.moe_planning.planned_segments`, never below any),
    elsewhere an even split of ``rows``."""
    experts = counts.shape[0]
    if planned(rows):
        return planned_segments(rows.shape[0], experts)
    if is_fake(counts):
        return fake_segments(rows.shape[0], experts)
    return counts.tolist()  # host sync


def fake_segments(rows: int, experts: int) -> list[int]:
    """The segment sizes under fake tensors outside the planner: an even split."""
    return [rows // experts + (e < rows % experts) for e in range(experts)]


def _segment_swiglu(rows, gate_up_proj, down_proj, counts) -> torch.Tensor:
    """rows [M, H] sorted by expert, counts [E] -> [M, H]: one matmul pair per expert
    with rows. Under fake tensors the sizes are unknown (:func:`segment_sizes`)."""
    # unbind once: one backward writes every expert's gradient into one [E, ...] tensor
    # (indexing gate_up_proj[e] per expert would give each a full-size zero gradient)
    gate_ups, downs = gate_up_proj.unbind(0), down_proj.unbind(0)
    outputs = []
    for expert, segment in enumerate(rows.split(segment_sizes(rows, counts))):
        if segment.shape[0]:
            hidden = _swiglu_halves(F.linear(segment, gate_ups[expert]))  # [n, I]
            outputs.append(F.linear(hidden, downs[expert]))  # [n, H]
    if not outputs:
        return rows.new_zeros(rows.shape)
    return torch.cat(outputs)


register_experts_kind("swiglu", _run_swiglu)


def experts_loop(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """The reference: for each expert, find its tokens, run it, add its weighted output
    (one ``nonzero`` and four small ops per expert with tokens)."""
    out = torch.zeros_like(x)
    for expert in range(gate_up_proj.shape[0]):
        token, slot = torch.nonzero(experts == expert, as_tuple=True)
        if token.numel():
            hidden = _swiglu_halves(F.linear(x[token], gate_up_proj[expert]))
            y = F.linear(hidden, down_proj[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y)
    return out


# ---------------------------------------------------------------------- the block
class SparseMoE(nn.Module):
    """A decoder layer's MoE MLP: ``x`` [B, S/P, H] -> ([B, S/P, H], router statistics
    [2E + 1]), token by token."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        *,
        shared_expert: nn.Module | None = None,
    ):
        """``shared_expert``: a dense MLP ``[N, H] -> [N, H]`` every token runs besides its
        routed experts (e.g. the family's SwiGLU ``MLP`` of
        ``shared_expert_intermediate_size``), held as ``shared_expert`` with its gate
        ``shared_expert_gate`` (a bias-free ``Linear(H, 1)``): transformers' names."""
        super().__init__()
        self.gate = Router(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, top_k)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            None if shared_expert is None else nn.Linear(hidden_size, 1, bias=False)
        )

    def route(self, flat: torch.Tensor):
        """flat [N, H] -> (probabilities [N, E], top-k weights [N, k], top-k experts [N, k])
        (a family whose router has another name or rule overrides this)."""
        return self.gate(flat)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, S/P, H] -> (out [B, S/P, H], this layer's router statistics [2E + 1],
        :func:`router_stats`): the statistics leave as an output, so that a compiled
        layer returns them like its hidden states."""
        flat = x.reshape(-1, x.shape[-1])  # [B*S/P, H]
        probs, weights, experts = self.route(flat)
        out = self.experts(flat, experts, weights)  # [N, H]
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(flat))  # [N, 1]
            out = out + gate * self.shared_expert(flat)
        return out.view_as(x), router_stats(probs, experts)


# ---------------------------------------------------------------------- statistics
def router_stats(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """One MoE layer's router statistics of this rank's tokens as one float64 tensor
    [2E + 1]: top-k assignments per expert (no gradient), router probabilities summed per
    expert (with their gradient), then the number of token rows. Layers add theirs
    (:func:`add_router_stats`); float64 keeps the counts exact at any length."""
    flat = experts.reshape(-1)  # [N*k]
    counts = torch.zeros(probs.shape[1], dtype=torch.float64, device=probs.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat, dtype=torch.float64))  # [E]
    rows = torch.full((1,), probs.shape[0], dtype=torch.float64, device=probs.device)
    return torch.cat([counts, probs.sum(dim=0).to(torch.float64), rows])


def split_layer_output(output) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's (or an MLP's) output as ``(hidden, router statistics or None)``: a layer
    with a :class:`SparseMoE` returns ``(hidden, stats [2E + 1])``, any other a tensor."""
    if isinstance(output, tuple):
        return output
    return output, None


def add_router_stats(total: torch.Tensor | None, stats: torch.Tensor | None):
    """The running sum of the layers' statistics (None until a layer has some)."""
    if stats is None:
        return total
    return stats if total is None else total + stats


def router_stat_rows(stats: torch.Tensor) -> int:
    """The (token, MoE layer) rows a statistics tensor counts."""
    return int(stats[-1].item())


def stats_from_router_logits(
    router_logits, top_k: int, real: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's router statistics ([2E + 1], :func:`router_stats` summed over the
    layers) from transformers' router logits (one ``[N, E]`` tensor per MoE layer, ``N``
    this rank's ``B*S/P`` tokens, as an HF model returns them with
    ``output_router_logits=True``), selected as transformers' ``load_balancing_loss_func``
    selects them: softmax over every expert, its top-k. ``real`` ([B, S/P] bool, None:
    all): the rows that count; the others (pads added to place documents) are left out,
    as transformers leaves out a padding mask's zeros."""
    total = None
    keep = None if real is None else real.reshape(-1)
    for logits in router_logits:
        probs = torch.softmax(logits.to(stats_dtype(logits.dtype)), dim=-1)  # [N, E]
        if keep is not None:
            probs = probs[keep.to(probs.device)]
        total = add_router_stats(
            total, router_stats(probs, torch.topk(probs, top_k, dim=-1).indices)
        )
    return total


def sp_router_aux_loss(
    stats: torch.Tensor, num_experts: int, group=None, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The load-balancing loss of the whole (SP-sharded) batch from this rank's
    statistics ``stats`` [2E + 1] (:func:`router_stats`, summed over the layers): see the
    module docstring. Returned in ``dtype``.

    One ``all_reduce`` of the ``[2E + 1]`` float64 numbers on ``group`` (``None``: single
    process). Value: from the all-reduced sums, the same bits on every rank; gradient:
    ``E * f_e / R`` per unit of this rank's probability sum, ``R`` the global row count.
    """
    probs = stats[num_experts : 2 * num_experts]  # [E], with gradient
    totals = stats.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    global_counts, global_probs, global_rows = totals.split([num_experts, num_experts, 1])
    global_rows = global_rows.clamp(min=1)
    share = global_counts / global_rows  # f_e
    value = num_experts * (share * global_probs / global_rows).sum()
    own = num_experts * (share * (probs - probs.detach()) / global_rows).sum()
    return (value + own).to(dtype)


def is_moe(module: nn.Module) -> bool:
    return isinstance(module, SparseMoE)


def has_experts(model: nn.Module) -> bool:
    return any(isinstance(m, SparseMoE) for m in model.modules())
