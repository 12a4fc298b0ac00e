"""The one swap entry point: transformers' linear token mixers replaced by usp's, which
compute them exactly under SP (the same parameters under the same names, loaded strictly).

:data:`SWAPS` maps a transformers class name to the function that builds usp's module
from it: Gated DeltaNet (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: :class:`usp.linear.GatedDeltaNet`)
and Mamba-2 (Bamba, Granite 4 hybrid, Nemotron-H, Falcon-H1, Zamba2:
:class:`usp.linear.mamba2_module.Mamba2Mixer`). :data:`USP_MIXERS` are the modules the
plug-in's check (:mod:`usp.models.hf_mixers`) accepts as exact.
"""

from __future__ import annotations

from torch import nn

from usp.errors import ModelConfigError
from usp.linear.mamba2_module import Mamba2Mixer
from usp.linear.module import GatedDeltaNet, GatedDeltaNetQkvz
from usp.sp.plan import as_plan

__all__ = ["SWAPS", "USP_MIXERS", "swap_linear_attention"]

#: token mixers usp computes exactly under SP (their children are not checked)
USP_MIXERS = (GatedDeltaNet, Mamba2Mixer)


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
}


def swap_linear_attention(model: nn.Module, plan, **attention_options) -> int:
    """Replace transformers' linear token mixers of ``model`` by usp's (:data:`SWAPS`:
    Gated DeltaNet of Qwen3.5 / Qwen3.5-MoE / Qwen3-Next; Mamba-2 of Bamba, Granite 4
    hybrid, Nemotron-H, Falcon-H1 and Zamba2), the same parameters loaded strictly, on the
    same device and dtype, computing under ``plan``; returns how many. Call it after
    loading the weights and before ``register(plan, model=model)``, FSDP or an optimizer
    (the parameters are new Parameter objects, on the same storage). ``attention_options`` go into the plan as
    :func:`usp.models.hf.register`'s do; the layers' kernels are the plan's
    ``linear_backend`` / ``linear_conv_backend`` ("auto" unless chosen). A layer usp
    cannot compute exactly is a ``ModelConfigError`` naming it (nothing swapped)."""
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
    return len(found)
