"""The one swap entry point: transformers' linear token mixers replaced by usp's, which
compute them exactly under SP (the same parameters under the same names, loaded strictly).

:data:`SWAPS` maps a transformers class name to the function that builds usp's module
from it: Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: :class:`usp.linear.GatedDeltaNet`),
Mamba-2 (Bamba, Granite 4 hybrid, Nemotron-H, Falcon-H1, Zamba2:
:class:`usp.linear.mamba2_module.Mamba2Mixer`), Mamba-1 (Jamba: :class:`usp.linear.Mamba1Mixer`),
Kimi Delta Attention (Kimi-Linear:
:class:`usp.linear.kda_module.KimiDeltaAttention`) and the short conv (LFM2, LFM2-MoE, LFM3:
:class:`usp.linear.ShortConv`). :data:`USP_MIXERS` are the modules the
plug-in's check (:mod:`usp.models.hf_mixers`) accepts as exact.
"""

from __future__ import annotations

from torch import nn

from usp.errors import ModelConfigError
from usp.linear.kda_module import KimiDeltaAttention
from usp.linear.mamba1 import Mamba1Mixer
from usp.linear.mamba2_module import Mamba2Mixer
from usp.linear.module import GatedDeltaNet, GatedDeltaNetQkvz
from usp.linear.short_conv import ShortConv
from usp.sp.plan import as_plan

__all__ = ["SWAPS", "USP_MIXERS", "swap_linear_attention"]

#: token mixers usp computes exactly under SP (their children are not checked)
USP_MIXERS = (GatedDeltaNet, Mamba2Mixer, KimiDeltaAttention, ShortConv, Mamba1Mixer)


def _gdn(cls):
    def build(module, plan):
        return cls(
            module.hidden_size, module.num_k_heads, module.num_v_heads, module.head_k_dim,
            module.head_v_dim, module.conv_kernel_size, module.layer_norm_epsilon,
            module.activation, plan=plan,
        )  # fmt: skip

    return build


def _mamba2(module, plan) -> Mamba2Mixer:
    """usp's Mamba-2 mixer with the settings of transformers' ``module``."""
    name = type(module).__name__
    if module.activation not in ("silu", "swish"):
        raise ModelConfigError(
            f"{name} runs its conv with activation {module.activation!r}; usp's Mamba-2 conv "
            "takes SiLU only: run this model with one SP rank"
        )
    if module.intermediate_size != module.num_heads * module.head_dim:
        raise ModelConfigError(
            f"{name}: intermediate size {module.intermediate_size} != {module.num_heads} heads "
            f"x {module.head_dim}; usp's Mamba-2 mixer splits it into heads"
        )
    norm = getattr(module, "norm", None)
    kind, eps = None, 1e-6
    if norm is not None and not isinstance(norm, nn.Identity):
        kind = "gated_after" if getattr(norm, "norm_before_gate", False) else "gated"
        eps = norm.variance_epsilon
        groups = getattr(norm, "n_groups", None) or module.intermediate_size // norm.group_size
        if groups != module.n_groups:
            raise ModelConfigError(
                f"{name}'s gated norm has {groups} groups, its scan {module.n_groups}; usp's "
                "Mamba-2 mixer normalises over the scan's groups"
            )
    return Mamba2Mixer(
        module.in_proj.in_features, module.num_heads, module.head_dim, module.n_groups,
        module.ssm_state_size, module.conv1d.kernel_size[0],
        proj_bias=module.in_proj.bias is not None, out_bias=module.out_proj.bias is not None,
        conv_bias=module.conv1d.bias is not None, activation="silu",
        time_step_limit=module.time_step_limit, norm=kind, norm_eps=eps,
        in_multiplier=getattr(module, "ssm_in_multiplier", None),
        mup_vector=getattr(module, "mup_vector", None), plan=plan,
    )  # fmt: skip


def _kda(module, plan) -> KimiDeltaAttention:
    """usp's Kimi Delta Attention with the settings of transformers' ``module``."""
    if module.activation not in ("silu", "swish"):
        raise ModelConfigError(
            f"{type(module).__name__} runs its conv with activation {module.activation!r}; "
            "usp's KDA conv takes SiLU only: run this model with one SP rank"
        )
    return KimiDeltaAttention(
        module.hidden_size, module.num_heads, module.head_dim, module.conv_kernel_size,
        module.layer_norm_epsilon, "silu", plan=plan,
    )  # fmt: skip


def _short_conv(module, plan) -> ShortConv:
    """usp's short conv with the settings of transformers' LFM2 ``module``."""
    conv = module.conv
    return ShortConv(conv.in_channels, conv.kernel_size[0], conv.bias is not None, plan=plan)


def _mamba1(module, plan) -> Mamba1Mixer:
    """usp's Mamba-1 mixer with the settings of transformers' Jamba ``module``."""
    if module.activation not in ("silu", "swish"):
        raise ModelConfigError(
            f"{type(module).__name__} runs its conv with activation {module.activation!r}; "
            "usp's Mamba-1 conv takes SiLU only: run this model with one SP rank"
        )
    return Mamba1Mixer(
        module.hidden_size, module.intermediate_size, module.ssm_state_size,
        module.time_step_rank, module.conv_kernel_size, conv_bias=module.use_conv_bias,
        proj_bias=module.use_bias, rms_norm_eps=module.dt_layernorm.variance_epsilon, plan=plan,
    )  # fmt: skip


#: transformers' classes :func:`swap_linear_attention` replaces, and how
SWAPS = {
    "Qwen3_5GatedDeltaNet": _gdn(GatedDeltaNet),
    "Qwen3_5MoeGatedDeltaNet": _gdn(GatedDeltaNet),
    "Qwen3NextGatedDeltaNet": _gdn(GatedDeltaNetQkvz),
    "BambaMixer": _mamba2,
    "GraniteMoeHybridMambaLayer": _mamba2,
    "NemotronHMamba2Mixer": _mamba2,
    "FalconH1Mixer": _mamba2,
    "Zamba2MambaMixer": _mamba2,
    "KimiLinearDeltaAttention": _kda,
    "Lfm2ShortConv": _short_conv,
    "Lfm2MoeShortConv": _short_conv,
    "Lfm3ShortConv": _short_conv,
    "JambaMambaMixer": _mamba1,
}


def swap_linear_attention(model: nn.Module, plan, **attention_options) -> int:
    """Replace transformers' linear token mixers of ``model`` by usp's (:data:`SWAPS`:
    Gated DeltaNet of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next; Mamba-2 of Bamba, Granite 4
    hybrid, Nemotron-H, Falcon-H1 and Zamba2; Jamba's Mamba-1; Kimi-Linear's KDA; the
    short convs of LFM2, LFM2-MoE and LFM3), the same parameters loaded strictly, on the
    same device and dtype, computing under ``plan``; returns how many. Call it after
    loading the weights and before ``register(plan, model=model)``, FSDP or an optimizer
    (the parameters are new Parameter objects, on the same storage).
    ``attention_options`` go into the plan as :func:`usp.models.hf.register`'s do; the
    layers' kernels are the plan's ``linear_backend`` / ``linear_conv_backend`` ("auto"
    unless chosen). A layer usp cannot compute exactly is a ``ModelConfigError`` naming it
    (nothing swapped). A mixer reads packed documents from the keywords its decoder layer
    passes on (``usp_packed``, ``cu_seq_lens_q``); a layer that gets them but does not pass
    them on (Jamba's Mamba layer in transformers 5.25) is refused at its call
    (:func:`_guard_documents`) rather than mixing the documents."""
    if attention_options:
        plan = as_plan(plan, **attention_options)
    found = [(path, m) for path, m in model.named_modules() if type(m).__name__ in SWAPS]
    built = [SWAPS[type(m).__name__](m, plan) for _, m in found]  # refusals before any swap
    for (path, module), usp_module in zip(found, built):
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        # the module's own tensors (device, dtype: fp32-kept A_log stays fp32), and its
        # non-persistent buffers (Falcon-H1's mup_vector) on its device
        usp_module.to(device=next(module.parameters()).device)
        usp_module.load_state_dict(module.state_dict(), strict=True, assign=True)
        usp_module.train(module.training)
        setattr(parent, attr, usp_module)
        _guard_documents(parent, usp_module, path)
    return len(found)


_PACKING_KEYWORDS = ("usp_packed", "cu_seq_lens_q", "packed")


def _packing(kwargs) -> object | None:
    return next((kwargs[k] for k in _PACKING_KEYWORDS if kwargs.get(k) is not None), None)


def _guard_documents(layer: nn.Module, mixer: nn.Module, path: str) -> None:
    """Refuse a call of ``mixer`` without the packed documents its decoder ``layer`` was
    called with (the layer's code does not pass them on: the mixer would run across the
    documents, a wrong answer without an error). Hook-local state: whether the layer's
    current call carried documents (set as the layer's call starts, cleared as it ends; a
    recompute under activation checkpointing re-runs a call that passed)."""
    layer_call = {"packed": False}

    def before_layer(module, args, kwargs):
        layer_call["packed"] = _packing(kwargs) is not None

    def after_layer(module, args, kwargs, output):
        layer_call["packed"] = False

    def before_mixer(module, args, kwargs):
        if layer_call["packed"] and _packing(kwargs) is None:
            raise ModelConfigError(
                f"{type(layer).__name__} ({path.rpartition('.')[0]}) was called with packed "
                f"documents but does not pass them on to its token mixer, so usp's "
                f"{type(mixer).__name__} cannot keep the documents apart: feed this model one "
                "document per row (no packing), with or without SP"
            )

    layer.register_forward_pre_hook(before_layer, with_kwargs=True)
    layer.register_forward_hook(after_layer, with_kwargs=True, always_call=True)
    mixer.register_forward_pre_hook(before_mixer, with_kwargs=True)
