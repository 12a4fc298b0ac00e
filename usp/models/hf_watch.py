"""Models that transformers builds with a usp attention name, seen while they are built.

transformers tells an attention function nothing when it builds a model with
``attn_implementation=name``, and a model that never calls attention (Mamba, RWKV, a model
with attention code of its own) never calls the function either: the plug-in's check at
the first attention or mask call would never run for it. So :func:`watch_construction`
(installed once, by :func:`usp.models.hf.register`) puts one hook into torch's module
registration (``torch.nn.modules.module.register_module_module_registration_hook``: it
runs when a module is assigned to another, that is while models are built, never in a
forward): a transformers model whose config names a usp attention function is handed to
that function's :class:`~usp.models.hf_mixers.MixerCheck` (``watch``), which under SP
inspects the model itself before its first forward computes anything. The hook finds the
check through transformers' own mask-function table (the usp mask function registered
under the name carries it), so usp keeps no table of its own.

A model that picks its attention class from a table keyed by the implementation name
(GPT-Neo's ``GPT_NEO_ATTENTION_CLASSES``, GIT's ``GIT_SELF_ATTENTION_CLASSES``) has no usp
entry in it: it is refused here, with the model named, instead of transformers' bare
``KeyError``.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys

import torch
from torch import nn

from usp.errors import ModelConfigError

#: a modeling file's own table of attention classes, indexed by the implementation name
_ATTENTION_TABLE = re.compile(r"\b([A-Z0-9_]*ATTENTION_CLASSES)\s*\[")


@functools.cache
def watch_construction() -> None:
    """Install the construction hook (once per process)."""
    from transformers import PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface

    def on_assignment(module: nn.Module, name: str, child: nn.Module) -> None:
        if not isinstance(module, PreTrainedModel):
            return None
        config = getattr(module, "config", None)
        implementation = getattr(config, "_attn_implementation_internal", None)
        if not isinstance(implementation, str):
            return None
        mask_function = AttentionMaskInterface._global_mapping.get(implementation)
        check = getattr(mask_function, "usp_check", None)
        if check is not None:
            refuse_attention_table(type(module), implementation)
            check.watch(module)
        return None

    torch.nn.modules.module.register_module_module_registration_hook(on_assignment)


@functools.cache
def attention_table(cls: type) -> str | None:
    """The name of the table of attention classes ``cls``'s modeling file indexes by
    implementation name, or None."""
    module = sys.modules.get(cls.__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):  # no source: nothing to tell
        return None
    found = _ATTENTION_TABLE.search(source)
    return found.group(1) if found else None


def refuse_attention_table(cls: type, name: str) -> None:
    """A :class:`ModelConfigError` naming the model when its modeling file picks attention
    classes from a table of its own (which has no entry ``name``)."""
    table = attention_table(cls)
    if table is None:
        return
    model_type = getattr(getattr(cls, "config_class", None), "model_type", None) or "?"
    raise ModelConfigError(
        f"{cls.__name__} (model_type {model_type!r}) picks its attention from a table of its "
        f"own ({table}), not from transformers' attention interface: "
        f"attn_implementation={name!r} (USP attention) cannot compute it. Build it with "
        "attn_implementation='sdpa' or 'eager' in one process (usp cannot run it under "
        "sequence parallelism), or train a model family usp computes (usp.models.FAMILIES)"
    )
