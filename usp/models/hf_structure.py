"""The parts of an HF transformers model the plug-in's check reads: its decoder, the
decoder's layers, and its absolute position embeddings (:mod:`usp.models.hf_mixers`
applies the rule)."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from torch import nn

#: class-name endings of a decoder's layers (besides transformers' GradientCheckpointingLayer)
LAYER_SUFFIXES = ("Layer", "Block")
#: names of modules, parameters and buffers that hold absolute positions: ``wpe``,
#: ``embed_positions``, ``position_embeddings``, ``pos_emb``...; classes named for them
POSITION_ATTRIBUTE = re.compile(r"(^|_)pos(_|$|it)|wpe|position", re.IGNORECASE)
POSITION_CLASS = re.compile(r"Position|Rotary")


@dataclass(frozen=True)
class Mixer:
    """One module that mixes tokens (or may): its path in the decoder, its class, why."""

    path: str
    cls: str
    why: str


def decoder_of(model: nn.Module) -> nn.Module:
    """The module holding the decoder's layers: ``model.get_decoder()``, or, where that
    is the causal LM itself (Llama 4's ``Llama4ForCausalLM``), the one transformers model
    inside it that holds them."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    while not layer_stack(decoder):
        inner = [m for m in decoder.children() if hasattr(m, "get_decoder")]
        if len(inner) != 1 or inner[0].get_decoder() is decoder:
            break
        decoder = inner[0].get_decoder()
    return decoder


def layer_stack(decoder: nn.Module) -> list[nn.Module]:
    """The decoder's layers: the members of its module lists that are layers (a
    transformers ``GradientCheckpointingLayer``, or a class named ``...Layer`` /
    ``...Block``). Their own code only adds and routes what their children return; any
    other member of a list (XLM's ``attentions``, ``ffns``) is inspected as a module."""
    layers = []
    for child in decoder.children():
        if isinstance(child, nn.ModuleList):
            layers.extend(m for m in child if _is_layer(m))
    return layers


def _is_layer(module: nn.Module) -> bool:
    if type(module).__name__.endswith(LAYER_SUFFIXES):
        return True
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


def position_mixers(decoder: nn.Module, *, skip=()) -> list[Mixer]:
    """The decoder's absolute position embeddings (learned or sinusoidal; modules,
    parameters or buffers named for positions) when the decoder's ``forward`` takes no
    ``position_ids``: it numbers each rank's shard from 0 itself (BART's decoder), and
    the global positions usp gives the model never reach the embedding. A decoder that
    takes ``position_ids`` is given the global ones (:func:`usp.models.shard_batch`) and
    checked by the attention call."""
    if "position_ids" in inspect.signature(decoder.forward).parameters:
        return []
    forward = f"{type(decoder).__name__}.forward"
    why = (
        f"an absolute position embedding, and {forward} takes no position_ids: it numbers "
        "each rank's shard from 0, the global positions never reach it"
    )
    found = []
    for path, module in decoder.named_modules():
        flagged = any(path == p or path.startswith(p + ".") for p in skip)
        if (
            path
            and not flagged
            and _names_positions(path.rpartition(".")[2], type(module).__name__)
        ):
            found.append(Mixer(path, type(module).__name__, why))
    for path, tensor in [*decoder.named_parameters(), *decoder.named_buffers()]:
        owner, _, attr = path.rpartition(".")
        if not owner and _names_positions(attr, ""):
            found.append(Mixer(path, type(tensor).__name__, why))
    return found


def _names_positions(attribute: str, class_name: str) -> bool:
    return bool(POSITION_ATTRIBUTE.search(attribute) or POSITION_CLASS.search(class_name))
