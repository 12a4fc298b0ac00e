"""The registry of model families: the one place the rest of usp asks about a model.

A :class:`ModelFamily` states, for one architecture: how its config is read from an HF
``config.json`` (its config class), how the model is built (its model class), its
presets, where its decoder layers are, its HF weight names (the parameter names, HF's
own), its parameter and FLOP counts (:mod:`usp.models.counts`) and its shape fields.
The trainer, checkpoints, FSDP2 wrapping, metrics and the planner call these functions;
nothing outside ``usp/models`` names a family's classes.

Adding a family is a file (``usp/models/<family>.py``: a config class, a model class,
presets) and one entry in :data:`FAMILIES` (docs/models.md: "Adding a model family").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from usp.errors import ModelConfigError
from usp.models import (
    gemma3,
    gpt_oss,
    granite_hybrid,
    llama,
    mistral,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
)
from usp.models.config import DecoderConfig, read_config_json
from usp.models.plan_inputs import plan_argument

#: why a model with sliding-window layers refuses ``[train] compile`` on an all-gather
#: ring: usp train packs documents, and the all-gather ring's windowed call over packed
#: documents does not compile (its per-document gathers would specialise the graph to one
#: packing: usp/sp/attend.py); the p2p ring masks its windowed blocks from device bounds
#: and compiles (usp.ring.masked_window)
WINDOW_COMPILE_REFUSAL = (
    "its sliding-window layers over packed documents compile only on the p2p ring "
    '(with ring_impl = "allgather" and a ring degree > 1 a windowed call is not traced); '
    'set [attention] ring_impl = "p2p"'
)


@dataclass(frozen=True)
class ModelFamily:
    """One family: its model class (a :class:`usp.models.decoder.CausalLM` subclass),
    which names its config class and presets."""

    model_class: type

    @property
    def name(self) -> str:
        return self.config_class.family

    @property
    def config_class(self) -> type[DecoderConfig]:
        return self.model_class.config_class

    @property
    def presets(self) -> dict[str, DecoderConfig]:
        return self.model_class.presets

    @property
    def architectures(self) -> tuple[str, ...]:
        return self.config_class.architectures

    def compile_refusal(self, plan, config: DecoderConfig) -> str | None:
        """Why ``[train] compile`` cannot compile the layers of ``config`` under ``plan``
        (a :class:`usp.Plan`) yet (None: it can): the family's own reason, or sliding
        windows when the ring all-gathers (``ring_impl = "allgather"``, ring degree > 1)."""
        if self.model_class.compile_refusal is not None:
            return self.model_class.compile_refusal
        if plan.ring_impl == "allgather" and plan.ring_degree > 1 and config.attention_window:
            return WINDOW_COMPILE_REFUSAL
        return None

    def kernel_refusal(self, config: DecoderConfig, plan, device, dtype) -> str | None:
        """Why a kernel ``plan`` forces (``[attention] linear_backend`` /
        ``linear_conv_backend``) cannot run the layers of ``config`` on ``device`` with
        activations of ``dtype``; None: it can, or nothing is forced (the model class's
        :meth:`~usp.models.decoder.CausalLM.kernel_refusal`). Runs no kernel."""
        return self.model_class.kernel_refusal(config, plan, device, dtype)

    def preset(self, name: str) -> DecoderConfig:
        try:
            return self.presets[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.name} preset {name!r}; known: {', '.join(self.presets)}"
            ) from None

    def build(self, config: DecoderConfig, /, plan=None, **attention_options) -> nn.Module:
        """The model, randomly initialised (on the meta device: uninitialised)."""
        plan = plan_argument(plan, attention_options, self.model_class.__name__)
        return self.model_class(config, plan, **attention_options)

    def from_pretrained(self, path, /, plan=None, **kwargs) -> nn.Module:
        plan = plan_argument(plan, kwargs, f"{self.model_class.__name__}.from_pretrained")
        return self.model_class.from_pretrained(path, plan, **kwargs)


#: every family usp trains natively; a new one is one line here (and its own file)
FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(llama.Llama),
    ModelFamily(qwen2.Qwen2),
    ModelFamily(qwen3.Qwen3),
    ModelFamily(mistral.Mistral),
    ModelFamily(qwen3_moe.Qwen3Moe),
    ModelFamily(gpt_oss.GptOss),
    ModelFamily(gemma3.Gemma3),
    # (before qwen3_5: its classes subclass those, and family_of takes the first match)
    ModelFamily(qwen3_5_moe.Qwen3_5Moe),
    ModelFamily(qwen3_5.Qwen3_5),
    ModelFamily(granite_hybrid.GraniteHybrid),
)

#: every family's presets by name (names are unique across families)
PRESETS: dict[str, DecoderConfig] = {
    name: config for family in FAMILIES for name, config in family.presets.items()
}


def supported() -> str:
    """The families and their HF architectures, for error messages."""
    return ", ".join(f"{f.name} ({', '.join(f.architectures)})" for f in FAMILIES)


def family_named(name: str) -> ModelFamily:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ModelConfigError(f"unknown model family {name!r}; known: {supported()}")


def family_of(thing) -> ModelFamily:
    """The family of a config, a model, or a config or model class."""
    cls = thing if isinstance(thing, type) else type(thing)
    for family in FAMILIES:
        if issubclass(cls, (family.config_class, family.model_class)):
            return family
    config = getattr(thing, "config", None)
    if config is not None and not isinstance(thing, type):
        return family_of(config)
    raise ModelConfigError(f"{cls.__name__} is not a usp model family's; known: {supported()}")


def family_for_hf(config: dict[str, Any], *, source: str = "config") -> ModelFamily:
    """The family an HF config dict names (``architectures``, else ``model_type``)."""
    for family in FAMILIES:
        if family.config_class.accepts(config):
            return family
    archs = config.get("architectures")
    model_type = config.get("model_type")
    if not archs and model_type is None:
        raise ModelConfigError(
            f"{source}: neither 'architectures' nor 'model_type' is set; usp's families: "
            f"{supported()}"
        )
    what = f"architecture {', '.join(map(str, archs))}" if archs else f"model_type {model_type!r}"
    raise ModelConfigError(
        f"{source}: {what} is not a usp model family; supported: {supported()}. Other HF "
        "models that use transformers' AttentionInterface run under USP via "
        "usp.models.hf.register (refused under SP where they mix tokens outside attention)"
    )


def config_from_hf(config: dict[str, Any], *, source: str = "config") -> DecoderConfig:
    """An HF config dict as its family's config."""
    return family_for_hf(config, source=source).config_class.from_hf_dict(config, source=source)


def config_from_file(path: str | Path) -> DecoderConfig:
    """An HF ``config.json`` file as its family's config."""
    return config_from_hf(read_config_json(path), source=str(path))


def preset(name: str) -> DecoderConfig:
    """The named preset of any family; an unknown name lists the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}") from None


def build(config: DecoderConfig, /, plan=None, **attention_options) -> nn.Module:
    """The model of ``config``'s family."""
    plan = plan_argument(plan, attention_options, "usp.models.family.build")
    return family_of(config).build(config, plan, **attention_options)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a usp model or of an HF causal LM (``get_decoder().layers``),
    in order: what FSDP2 wraps one by one and what the levers act on."""
    layers = getattr(model, "decoder_layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    raise ModelConfigError(
        f"{type(model).__name__} has no decoder layers usp can find (a usp model's "
        "decoder_layers, or an HF model's get_decoder().layers)"
    )
