"""The Mamba-2 token mixer as a part of the stack (transformers' ``mamba``: Granite 4
hybrid's ``linear_attention`` layers): :class:`usp.linear.Mamba2Mixer` built from a
config's ``mamba_*`` fields, exact under Ulysses x ring (:func:`usp.linear.mamba2_usp`);
the checks of those fields (:func:`check_config`); its initialisation as transformers';
the construction-time check of its heads against
the Ulysses degree; the refusal of a forced kernel that cannot run it; its scan's FLOPs.

Parameter names are transformers' (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``,
``D``, ``norm``, ``out_proj``): checkpoints load and export unchanged.
"""

from __future__ import annotations

import math

import torch

from usp.errors import ModelConfigError
from usp.linear import scan_backends
from usp.linear.choice import Mamba2Shape, forced_kernel_refusal
from usp.linear.mamba2_module import Mamba2Mixer
from usp.models.config import check_integers
from usp.process_groups.degrees import kv_replication_for

#: what the construction-time check calls a Mamba-2 layer's two head counts
MAMBA2_HEADS = ("Mamba-2 heads", "B/C groups")
#: the config fields (transformers' names) that decide a Mamba-2 layer's parameter shapes
SHAPE_FIELDS = ("mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
                "mamba_expand", "mamba_d_head", "mamba_conv_bias", "mamba_proj_bias")  # fmt: skip
#: the torch kernel's chunk length (work, not results: any chunk gives the same numbers)
CHUNK = 64


def check_config(config) -> None:
    """Check (and complete, in place on a frozen config) a config's Mamba-2 fields as
    transformers does: ``mamba_d_head = "auto"`` is ``mamba_expand * hidden_size //
    mamba_n_heads``; heads x head dim = expand x hidden; heads a multiple of the B/C
    groups; ``time_step_limit`` ``[low, high]``, 0 <= low <= high (a tuple of floats)."""
    heads = config.mamba_n_heads
    if config.mamba_d_head == "auto" and isinstance(heads, int) and heads > 0:
        object.__setattr__(
            config, "mamba_d_head", config.mamba_expand * config.hidden_size // heads
        )
    check_integers(config, dict.fromkeys(SHAPE_FIELDS[:6], 1))
    groups, expand, dim = config.mamba_n_groups, config.mamba_expand, config.mamba_d_head
    if heads * dim != expand * config.hidden_size or heads % groups:
        raise ModelConfigError(
            f"mamba_n_heads({heads}) x mamba_d_head({dim}) must equal mamba_expand({expand}) "
            f"x hidden_size({config.hidden_size}) and mamba_n_heads be a multiple of "
            f"mamba_n_groups({groups}); fix them (mamba_d_head 'auto' fits)"
        )
    limit = tuple(config.time_step_limit or (0.0, math.inf))
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in limit)
    if len(limit) != 2 or not numbers or not 0 <= limit[0] <= limit[1]:
        raise ModelConfigError(
            f"time_step_limit must be [low, high] with 0 <= low <= high, got "
            f"{config.time_step_limit!r}"
        )
    object.__setattr__(config, "time_step_limit", tuple(float(v) for v in limit))


def build(config, plan) -> Mamba2Mixer:
    """The layer's Mamba-2 mixer: x [B, S/P, hidden] -> [B, S/P, hidden]; z gates before
    the grouped RMSNorm (transformers' ``norm_before_gate=False``)."""
    return Mamba2Mixer(
        config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
        config.mamba_d_state, config.mamba_d_conv, proj_bias=config.mamba_proj_bias,
        conv_bias=config.mamba_conv_bias, activation="silu",
        time_step_limit=config.time_step_limit, norm="gated", norm_eps=config.rms_norm_eps,
        plan=plan, chunk_size=CHUNK,
    )  # fmt: skip


def shape(config) -> Mamba2Shape:
    return Mamba2Shape(config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                       config.mamba_d_state, config.mamba_d_conv)  # fmt: skip


def check_heads(plan, config) -> None:
    """Fail at model construction when the Ulysses degree cannot split the Mamba-2 heads
    (heads over u; B/C groups repeated as KV heads are for GQA)."""
    if plan.topology.single_process:
        return
    heads, groups = config.mamba_n_heads, config.mamba_n_groups
    kv_replication_for(
        heads, groups, plan.ulysses_degree, plan.sp_degree,
        plan.topology.rank_map.ranks_per_node, names=MAMBA2_HEADS,
        subject=f"this model's {heads} Mamba-2 heads / {groups} B/C groups cannot be split "
        f"over ulysses={plan.ulysses_degree}",
    )  # fmt: skip


def kernel_refusal(config, plan, device, dtype) -> str | None:
    """Why a scan or conv kernel the plan forces (``linear_backend`` /
    ``linear_conv_backend``) cannot run these layers on ``device`` in ``dtype``; None: it
    can."""
    return forced_kernel_refusal(
        plan.linear_backend, plan.linear_conv_backend, device, dtype, shape(config),
        plan.ulysses_degree, kernels=scan_backends.DEFAULT, mixer="Mamba-2",
    )  # fmt: skip


@torch.no_grad()
def init_weights(module: Mamba2Mixer, std: float, generator=None) -> None:
    """As transformers (after the stack's linear layers are drawn): the conv weight
    normal(0, std) and its bias 0, ``dt_bias`` 1, ``A_log`` = log(1..H), ``D`` 1, the
    gated norm 1."""
    module.conv1d.weight.normal_(0.0, std, generator=generator)
    if module.conv1d.bias is not None:
        module.conv1d.bias.zero_()
    module.dt_bias.fill_(1.0)
    heads = torch.arange(1, module.num_heads + 1, dtype=module.A_log.dtype)
    module.A_log.copy_(heads.log())
    module.D.fill_(1.0)
    module.norm.weight.fill_(1.0)


def flops_per_token(config, chunk: int = CHUNK) -> int:
    """Forward FLOPs per token of one layer's chunked scan (chunks of ``chunk``; G groups,
    H heads of dim P, state N): the in-chunk ``C B^T`` per group (``2 C N``), the in-chunk
    output per head (``2 C P``), the state's update and its read per head (``2 N P``
    each): ``2 C N G + H (2 C P + 4 N P)``. Projections count as matmuls; the conv
    (``2 K`` per channel) is left out (small)."""
    heads, dim = config.mamba_n_heads, config.mamba_d_head
    state, groups = config.mamba_d_state, config.mamba_n_groups
    return 2 * chunk * state * groups + heads * (2 * chunk * dim + 4 * state * dim)
