"""The Gated DeltaNet token mixer as a part of the stack (transformers' ``linear_attn``:
Qwen3.5's ``linear_attention`` layers): :class:`usp.linear.GatedDeltaNet` built from a
config's ``linear_*`` fields, exact under Ulysses x ring; its initialisation as
transformers'; the construction-time check of its heads against the Ulysses degree; the
refusal of a forced kernel that cannot run it; its recurrence's FLOPs.
"""

from __future__ import annotations

import torch

from usp.linear.choice import GDN_HEADS, GdnShape, forced_kernel_refusal
from usp.linear.module import GatedDeltaNet
from usp.process_groups.degrees import kv_replication_for


def build(config, plan) -> GatedDeltaNet:
    """The layer's GDN mixer: x [B, S/P, hidden] -> [B, S/P, hidden]."""
    return GatedDeltaNet(
        config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
        config.linear_key_head_dim, config.linear_value_head_dim,
        config.linear_conv_kernel_dim, config.rms_norm_eps, "silu", plan=plan,
    )  # fmt: skip


def shape(config) -> GdnShape:
    return GdnShape(
        config.linear_num_key_heads, config.linear_num_value_heads,
        config.linear_key_head_dim, config.linear_value_head_dim,
        config.linear_conv_kernel_dim,
    )  # fmt: skip


def check_linear_heads(plan, config) -> None:
    """Fail at model construction when the Ulysses degree cannot split the GDN heads
    (value heads over u; key heads repeated as KV heads are for GQA)."""
    if plan.topology.single_process:
        return
    values, keys = config.linear_num_value_heads, config.linear_num_key_heads
    kv_replication_for(
        values, keys, plan.ulysses_degree, plan.sp_degree,
        plan.topology.rank_map.ranks_per_node, names=GDN_HEADS,
        subject=f"this model's {values} GDN value heads / {keys} key heads cannot be split "
        f"over ulysses={plan.ulysses_degree}",
    )  # fmt: skip


def kernel_refusal(config, plan, device, dtype) -> str | None:
    """Why a GDN kernel the plan forces (``linear_backend`` / ``linear_conv_backend``)
    cannot run these layers on ``device`` in ``dtype`` (its limits); None: it can."""
    return forced_kernel_refusal(
        plan.linear_backend, plan.linear_conv_backend, device, dtype, shape(config),
        plan.ulysses_degree,
    )  # fmt: skip


@torch.no_grad()
def init_weights(module: GatedDeltaNet, std: float, generator=None) -> None:
    """As transformers (after the stack's linear layers are drawn): the conv weights
    normal(0, std), the gated norm 1, ``dt_bias`` 1, ``A_log`` = log(uniform(0.01, 16))."""
    module.conv1d.weight.normal_(0.0, std, generator=generator)
    module.dt_bias.fill_(1.0)
    module.norm.weight.fill_(1.0)
    low = torch.empty_like(module.A_log).uniform_(0.01, 16, generator=generator)
    module.A_log.copy_(low.log())


def flops_per_token(config, chunk: int = 64) -> int:
    """Forward FLOPs per token of one layer's chunked recurrence (chunks of ``chunk``, per
    value head): the in-chunk products ``K K^T`` and ``Q K^T`` (``2 C dk`` each), the two
    triangular solves (``C (dk + dv)``), the in-chunk output (``2 C dv``) and the three
    products with the state (``2 dk dv`` each): ``C (5 dk + 3 dv) + 6 dk dv``.
    Projections count as matmuls; the conv (``2 K`` per channel) is left out (small)."""
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    return config.linear_num_value_heads * (chunk * (5 * dk + 3 * dv) + 6 * dk * dv)
