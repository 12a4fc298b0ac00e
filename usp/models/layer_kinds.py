"""The kinds of decoder layer, in transformers' ``layer_types`` names, and the config
mixin of the families whose ``config.json`` lists them.

Every config says each layer's kind (``DecoderConfig.layer_kinds``): ``full_attention``
(causal attention over the whole prefix), ``sliding_attention`` (over the
``sliding_window`` keys up to the token), ``linear_attention`` (Gated DeltaNet) or
``mamba`` (Mamba-2: transformers' older name for the layers Granite 4 hybrid's config now
calls ``linear_attention``; that family reads them as ``mamba``). The kind chooses the layer's token mixer (:data:`usp.models.mixers.MIXER_OF_KIND`). Llama
has full layers only, Mistral and Qwen's windowed configs derive theirs from
``sliding_window``; Gemma 3, gpt-oss and Qwen3.5 name them in ``layer_types``, read and
checked by :class:`LayerTypes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from usp.errors import ModelConfigError

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
MAMBA = "mamba"


def check_window(window) -> None:
    """``sliding_window`` is null or an integer >= 1."""
    if window is not None and (not isinstance(window, int) or isinstance(window, bool)
                               or window < 1):  # fmt: skip
        raise ModelConfigError(f"sliding_window must be an integer >= 1 or null, got {window!r}")


@dataclass(frozen=True)
class LayerTypes:
    """A family config's ``layer_types``: each layer's kind, ``None`` read as the family's
    default pattern (:meth:`default_layer_types`), checked (kinds the family computes,
    one per layer, a ``sliding_window`` for sliding layers). Another depth without
    ``layer_types`` keeps the layers' kinds in order, repeating them past the last (the
    planner's shallower copies measure the model's first layers). A mixin before
    :class:`DecoderConfig` in a config's bases."""

    layer_types: tuple[str, ...] | None = None

    #: the kinds the family's layers may be
    known_kinds: ClassVar[tuple[str, ...]] = (FULL, SLIDING)
    #: the config.json key of the family's layer pattern, read when ``layer_types`` is
    #: absent (Gemma 3's ``sliding_window_pattern``, Qwen3.5's ``full_attention_interval``;
    #: None: no such key), and its default
    pattern_key: ClassVar[str | None] = None
    default_pattern: ClassVar[int] = 1

    @classmethod
    def pattern_layer_types(cls, layers: int, pattern: int) -> tuple[str, ...]:
        """The kinds of ``layers`` layers under the family's pattern ``pattern``."""
        raise NotImplementedError

    @classmethod
    def default_layer_types(cls, layers: int) -> tuple[str, ...]:
        """The family's kinds of ``layers`` layers when ``layer_types`` is not given."""
        return cls.pattern_layer_types(layers, cls.default_pattern)

    @classmethod
    def from_hf_dict(cls, config: dict, *, source: str = "config"):
        """``layer_types`` as given, or from the pattern key (its default if absent)."""
        config = dict(config)
        pattern = config.pop(cls.pattern_key, cls.default_pattern) if cls.pattern_key else None
        if config.get("layer_types") is None:
            config.pop("layer_types", None)
            if pattern is not None:
                if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
                    raise ModelConfigError(
                        f"{source}: {cls.pattern_key} must be an integer >= 1, got {pattern!r}"
                    )
                layers = config.get("num_hidden_layers")
                if isinstance(layers, int):
                    config["layer_types"] = list(cls.pattern_layer_types(layers, pattern))
        return super().from_hf_dict(config, source=source)

    def __post_init__(self) -> None:
        super().__post_init__()  # DecoderConfig's checks
        layers = self.num_hidden_layers
        types = self.layer_types
        types = self.default_layer_types(layers) if types is None else tuple(types)
        object.__setattr__(self, "layer_types", types)
        unknown = sorted({t for t in types if t not in self.known_kinds}, key=str)
        if unknown:
            raise ModelConfigError(
                f"layer_types must name one of {', '.join(map(repr, self.known_kinds))} for "
                f"each layer: {unknown} are not {self.family.replace('_', '-')} layer kinds"
            )
        if len(types) != layers:
            raise ModelConfigError(
                f"layer_types names {len(types)} layers, num_hidden_layers is {layers}: give "
                f"one of {', '.join(map(repr, self.known_kinds))} for each of the {layers} layers"
            )
        window = getattr(self, "sliding_window", None)
        check_window(window)
        if window is None and SLIDING in types:
            raise ModelConfigError(
                "sliding_window is null but layer_types has sliding_attention layers: give "
                "the window"
            )

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return self.layer_types

    def replace(self, **changes):
        layers = changes.get("num_hidden_layers", self.num_hidden_layers)
        if "layer_types" not in changes and layers != self.num_hidden_layers:
            types = self.layer_types  # in order, repeated past the last
            changes["layer_types"] = tuple(types[i % len(types)] for i in range(layers))
        return super().replace(**changes)

    def to_hf_dict(self, *, dtype: str | None = None):
        out = super().to_hf_dict(dtype=dtype)
        out["layer_types"] = list(self.layer_types)
        return out

    def layer_variants(self):
        """One single-layer config per kind, in order of first appearance, and its count."""
        return [
            (self.replace(num_hidden_layers=1, layer_types=(kind,)), self.layer_types.count(kind))
            for kind in dict.fromkeys(self.layer_types)
        ]
