"""The language model of a multimodal checkpoint (``...ForConditionalGeneration``: Gemma 3,
Qwen3.5), read as the text family's own: its ``config.json``'s ``text_config`` and its
checkpoint keys. The vision tower and what else the family names are not read; the
export is the text-only ``...ForCausalLM``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from usp.errors import ModelConfigError

#: a multimodal checkpoint's language-model keys as the text model's (as published,
#: as transformers 5 writes them)
LANGUAGE_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def language_model_key(key: str, not_read: re.Pattern) -> str | None:
    """The text model's parameter name of a checkpoint key; None for a key ``not_read``
    matches (a vision tower, a multi-token-prediction head)."""
    if not_read.match(key):
        return None
    for prefix, replacement in LANGUAGE_MODEL_PREFIXES:
        if key.startswith(prefix):
            return replacement + key[len(prefix) :]
    return key


@dataclass(frozen=True)
class MultimodalText:
    """A text family's config that also reads its multimodal checkpoints' config.json
    (``multimodal_type``, the architectures ending in ``ForConditionalGeneration``). A
    mixin before :class:`usp.models.config.DecoderConfig` in a config's bases."""

    #: the multimodal config.json's model_type
    multimodal_type: ClassVar[str] = ""
    #: transformers' text-config defaults for the keys every config.json must give
    #: elsewhere (a multimodal checkpoint's text_config often leaves them out)
    text_defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def accepts(cls, config: dict[str, Any]) -> bool:
        archs = config.get("architectures") or []
        if archs:
            return bool(set(archs) & set(cls.architectures))
        return config.get("model_type") in (cls.model_type, cls.multimodal_type)

    @classmethod
    def text_dict(cls, config: dict[str, Any], source: str) -> dict[str, Any]:
        """The text model's config dict: a multimodal config's ``text_config`` with
        transformers' defaults for what it leaves out (the weights' dtype and the tying
        stated at the top), or a copy of a text config."""
        archs = config.get("architectures") or []
        multimodal = any(a.endswith("ForConditionalGeneration") for a in archs) or (
            not archs and config.get("model_type") == cls.multimodal_type
        )
        if not multimodal:
            return dict(config)
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ModelConfigError(
                f"{source}: a multimodal {cls.family} config.json without a text_config "
                "object: usp trains its language model and needs that config"
            )
        out = {**cls.text_defaults, **text}
        for key in ("torch_dtype", "dtype", "tie_word_embeddings"):
            if key in config:
                out.setdefault(key, config[key])
        out["architectures"] = [cls.architectures[0]]
        out["model_type"] = cls.model_type
        return out

    @classmethod
    def hf_read_only(cls) -> tuple[str, ...]:
        return ("text_config", "vision_config")
