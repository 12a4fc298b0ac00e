"""The multimodal parts of an HF model under the USP attention plug-in: computed or refused.

A vision-language model (Qwen3-VL, Qwen3.5, Gemma 3, ...) built with
``attn_implementation=usp`` hands the plug-in three things a text model does not:

* **its encoders' attention** (a vision or audio tower: its module's config is a
  sub-config such as ``vision_config``). That attention is over one image's patches, not
  over the sequence's shard: it is computed here as the local encoder it is
  (transformers' sdpa path, what the stock model runs), never as USP attention. Under
  SP a forward that encodes images itself is refused: each rank would hold every
  image's features for its shard's image tokens only (transformers then fails with
  "Image features and image tokens do not match", differently per rank).
  :func:`usp.models.hf.shard_multimodal` spreads the images over the SP ranks instead;
  its own encoding step runs inside :meth:`MultimodalChecks.own_encoding`.
* **multimodal positions**: Qwen's RoPE has t/h/w rows (``get_rope_index``) that differ
  from ``0..S-1`` after an image. A forward that encoded images and was given
  ``position_ids`` (the batch's 1-D positions from :func:`usp.models.shard_batch`) would
  rotate by the wrong positions: refused, in one process too (pass no ``position_ids``,
  so that the model computes its own, or use ``shard_multimodal``).
* **mask overlays**: Gemma 3's ``token_type_ids`` add a bidirectional mask over each
  image block (``blockwise_overlay``), PaliGemma's a prefix; the plug-in's mask function
  builds no mask, so such an overlay is read from the mask function transformers hands
  it (:func:`mask_overlays`) and a causal layer that would drop it is refused.
  ``shard_multimodal`` passes the image blocks itself (:data:`IMAGE_BLOCKS_KWARG`) and
  usp computes them.

:class:`ForwardSeen` keeps what one forward showed (an encoder ran, an overlay was
built) between the calls transformers makes: encoders first, then the masks, then the
layers' attention.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from typing import NamedTuple

import torch

from usp.compile_marks import constant_result
from usp.models.hf_image_blocks import block_partial
from usp.models.hf_padding import HFInputError

#: the keyword that carries Gemma 3's image blocks to the attention (usp computes them)
IMAGE_BLOCKS_KWARG = "usp_image_blocks"
#: sub-config keys of encoders: their attention is over an image's (or a clip's) own
#: patches, never over the text sequence
ENCODER_CONFIG_KEYS = (
    "vision_config", "audio_config", "audio_video_config", "vq_config", "encoder_config",
    "qformer_config", "image_config", "prompt_encoder_config", "backbone_config",
)  # fmt: skip
#: processor outputs of vision-language models (a text batch has none of them)
MULTIMODAL_INPUT_KEYS = (
    "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
    "mm_token_type_ids", "token_type_ids", "image_sizes", "pixel_attention_mask",
    "mm_encoder_outputs", "image_position_ids", "second_per_grid_ts", "input_features",
)  # fmt: skip

_MASKS = "transformers.masking_utils"
#: mask functions (module, qualname) the plug-in computes without a mask: causality,
#: and restrictions it handles itself (windows, documents, padding)
_PLAIN_MASKS = {
    (_MASKS, "causal_mask_function"),
    (_MASKS, "bidirectional_mask_function"),
    (_MASKS, "sliding_window_overlay.<locals>.inner_mask"),
    (_MASKS, "sliding_window_bidirectional_overlay.<locals>.inner_mask"),
    (_MASKS, "chunked_overlay.<locals>.inner_mask"),
    (_MASKS, "packed_sequence_mask_function.<locals>.inner_mask"),
    (_MASKS, "padding_mask_function.<locals>.inner_mask"),
}
_COMBINERS = {"or_masks.<locals>.or_mask": "or", "and_masks.<locals>.and_mask": "and"}


def is_encoder_config(config) -> bool:
    """Whether ``config`` (an attention module's) is an encoder's sub-config."""
    return getattr(config, "base_config_key", "") in ENCODER_CONFIG_KEYS


def encoder_sub_configs(config: dict) -> list[str]:
    """The encoder sub-configs a ``config.json`` dict holds (a vision-language model's
    ``vision_config``, ...)."""
    return [key for key in ENCODER_CONFIG_KEYS if isinstance(config.get(key), dict)]


def multimodal_inputs(inputs) -> list[str]:
    """The processor outputs of a vision-language model among ``inputs`` (a mapping)."""
    return [key for key in MULTIMODAL_INPUT_KEYS if inputs.get(key) is not None]


# ----------------------------------------------------------------------------- masks
class Overlay(NamedTuple):
    """A mask function transformers combined with causality that usp does not compute:
    ``adds`` (under an or: more keys than causal) or restricts (under an and)."""

    name: str
    adds: bool


#: what a compiled graph's mask function shows of an overlay (closures made while
#: tracing cannot be read): transformers asks for a vmapped mask when the model adds one
COMPILED_OVERLAY = Overlay("a mask function the model adds (or_mask/and_mask_function)", True)


def mask_overlays(mask_function) -> list[Overlay]:
    """The parts of ``mask_function`` (transformers' ``or_masks``/``and_masks`` tree of
    index functions) that are neither causality nor a restriction the plug-in handles
    (windows, documents, padding). Read from the functions' closures: index functions
    cannot be evaluated on a shard under SP, where the mask function sees local indices."""
    found: list[Overlay] = []
    _walk(mask_function, None, found, depth=0)
    return found


def _walk(fn, combiner: str | None, found: list[Overlay], depth: int) -> None:
    if depth > 16 or not callable(fn):
        return
    key = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", type(fn).__name__))
    if key in _PLAIN_MASKS:
        return
    inner = _inner_functions(fn)
    if key[0] == _MASKS and key[1] in _COMBINERS:
        for child in inner:
            _walk(child, _COMBINERS[key[1]], found, depth + 1)
    elif inner and key[0] == _MASKS:  # a wrapper (remap_positions_for_packed_sequence)
        for child in inner:
            _walk(child, combiner, found, depth + 1)
    else:
        found.append(Overlay(f"{key[0]}.{key[1]}", adds=combiner != "and"))


def _inner_functions(fn) -> list:
    """The functions a closure holds (directly, or in a tuple as ``or_masks`` keeps them)."""
    functions = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        values = value if isinstance(value, tuple) else (value,)
        functions += [v for v in values if inspect.isfunction(v)]
    return functions


# ----------------------------------------------------------------------------- positions
@functools.cache
def _has_multimodal_positions(config_class: type) -> bool:
    """Whether the model family of ``config_class`` computes its own RoPE positions from
    its images (a class of its modeling module defines ``get_rope_index``: Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL, Qwen3.5, GLM-4V, ...)."""
    module_name = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    return any(
        isinstance(obj, type) and "get_rope_index" in vars(obj) for obj in vars(module).values()
    )


def multimodal_positions(config) -> bool:
    """Whether ``config``'s model rotates by multimodal positions (t/h/w rows)."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if isinstance(rope, dict) and "mrope_section" in rope:
        return True
    return _has_multimodal_positions(type(config))


# ----------------------------------------------------------------------------- one forward
class ForwardSeen:
    """What the current forward showed the plug-in before its layers' attention.

    transformers calls a model's encoders first, then the mask functions, then the
    layers; a call of an earlier kind after a layer's attention starts a new forward.
    (A gradient-checkpointed layer recomputed in the backward is a layer call again.)"""

    def __init__(self):
        self.images = False  # an encoder ran in this forward (not usp's own encoding)
        self.overlays: list[Overlay] = []
        self._phase = "layers"

    def _start(self, phase: str) -> None:
        if self._phase == "layers":
            self.images, self.overlays = False, []
        self._phase = phase

    def encoder_ran(self) -> None:
        self._start("encoders")
        self.images = True

    def mask_built(self, overlays: list[Overlay]) -> None:
        self._start("masks")
        self.overlays = self.overlays + [o for o in overlays if o not in self.overlays]

    def layer_called(self) -> None:
        self._phase = "layers"


class MultimodalChecks:
    """The plug-in's verdicts on a model's multimodal parts (see the module docstring),
    for the attention function and the mask function registered under ``name``."""

    def __init__(self, plan, name: str):
        self.plan, self.name = plan, name
        self.seen = ForwardSeen()
        self.encoding = False  # inside usp's own encoding step (shard_multimodal's)

    @contextlib.contextmanager
    def own_encoding(self):
        """usp's own encoding step: the encoders' attention runs locally, under SP too."""
        before, self.encoding = self.encoding, True
        try:
            yield
        finally:
            self.encoding = before

    # ------------------------------------------------------------------ masks
    def wrap_mask_function(self, mask_fn):
        """``mask_fn`` (the plug-in's mask function), recording the overlays of every
        mask transformers builds (before any layer runs)."""

        @functools.wraps(mask_fn)
        def usp_mask(*args, mask_function=None, **kwargs):
            if torch.compiler.is_compiling():
                overlays = (COMPILED_OVERLAY,) if kwargs.get("use_vmap") else ()
            else:
                overlays = tuple(mask_overlays(mask_function)) if mask_function else ()
            _mask_built(self.seen, overlays)
            return mask_fn(*args, mask_function=mask_function, **kwargs)

        return usp_mask

    # ------------------------------------------------------------------ encoders
    def encoder_attention(self, module, query, key, value, attention_mask, agreed, **kwargs):
        """An encoder's attention, computed locally (transformers' sdpa), or under SP
        without usp's encoding step refused on every SP rank (``agreed``: the plug-in's
        per-forward agreement, which ranks without images reach from their first
        layer)."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        own_step = self.encoding
        unsupported = {k: kwargs.pop(k, None) for k in ("sliding_window", "softcap")}
        unsupported = {k: v for k, v in unsupported.items() if v is not None}
        if unsupported:
            raise HFInputError(
                f"attn_implementation={self.name!r}: the encoder attention "
                f"{type(module).__name__} has {unsupported}, which usp's local encoder path "
                "(transformers' sdpa) does not apply; build the encoder with "
                "attn_implementation='eager' for its sub-config"
            )
        if not own_step:
            _encoder_ran(self.seen)
        if self.plan.sp_degree > 1 and not own_step:
            error = HFInputError(self._images_under_sp(module))

            def refuse():
                raise error

            agreed(refuse)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def _images_under_sp(self, module) -> str:
        return (
            f"attn_implementation={self.name!r}: the model encoded images (or other media) "
            f"itself ({type(module).__name__}) under sequence parallelism "
            f"(ulysses {self.plan.ulysses_degree} x ring {self.plan.ring_degree}): each rank "
            "holds a shard of the sequence, so its image tokens would not match the features "
            "and the model's multimodal positions would be computed on a shard. Give the "
            "processor outputs to usp.models.hf.shard_multimodal(plan, model, input_ids, "
            "**processor_outputs) and call model(**batch.hf_kwargs()) without pixel_values: "
            "it spreads the images over the SP ranks and places their features and positions"
        )

    # ------------------------------------------------------------------ layers
    def layer_problem(self, module, kwargs: dict, causal: bool) -> str | None:
        """Why this layer's attention cannot be computed exactly given what the forward
        showed, or None. The same on every rank that got the same kind of inputs; the
        plug-in raises it through its per-forward agreement."""
        config = getattr(module, "config", None)
        has_positions = kwargs.get("position_ids") is not None
        has_blocks = kwargs.get(IMAGE_BLOCKS_KWARG) is not None
        return _layer_problem(
            self, type(module).__name__, config, causal, has_positions, has_blocks
        )

    def problem(self, module_name, config, causal, has_positions, has_blocks) -> str | None:
        """:meth:`layer_problem` from what it reads of the call (plain values)."""
        self.seen.layer_called()
        overlays = [o for o in self.seen.overlays if causal or not o.adds]
        if overlays and not has_blocks:
            return self._overlay_message(module_name, overlays)
        if self.seen.images and has_positions and multimodal_positions(config):
            return (
                f"attn_implementation={self.name!r}: this forward encoded images and was "
                f"given position_ids, but {type(config).__name__} rotates by multimodal "
                "positions (t/h/w rows from the model's get_rope_index, which differ from "
                "0..S-1 after an image): the batch's 1-D positions would replace them. Pass "
                "no position_ids (in one process the model computes its own from "
                "mm_token_type_ids), or use usp.models.hf.shard_multimodal(plan, model, "
                "input_ids, **processor_outputs), which places them"
            )
        return None

    def partial(self, kwargs: dict, q, k, v, scaling, causal: bool):
        """The ``partial`` of USP attention for Gemma 3's image blocks (their later keys,
        :mod:`usp.models.hf_image_blocks`), or None: no blocks, or a bidirectional layer
        (which sees them anyway)."""
        blocks = kwargs.get(IMAGE_BLOCKS_KWARG)  # (every rank has them: the batch has blocks)
        if blocks is None or not causal:
            return None
        return block_partial(blocks, q, k, v, scaling, self.plan.comm_stats)

    def _overlay_message(self, module_name: str, overlays: list[Overlay]) -> str:
        names = ", ".join(sorted({o.name for o in overlays}))
        blocks = any("blockwise_overlay" in o.name for o in overlays)
        hint = (
            " (Gemma 3's token_type_ids make each image block bidirectional): use "
            "usp.models.hf.shard_multimodal(plan, model, input_ids, **processor_outputs), "
            "which computes the image blocks, and do not pass token_type_ids to the model"
            if blocks
            else ": give inputs without it, or use attn_implementation='sdpa' in one process"
        )
        return (
            f"attn_implementation={self.name!r} (USP attention) computes causal, sliding or "
            f"bidirectional attention, but the model's mask for {module_name} "
            f"adds a pattern usp does not apply ({names}){hint}"
        )


# ----------------------------------------------------------------------------- compiled
# The bookkeeping of one forward runs eagerly while a compiled graph is traced (the
# calls' order is the forward's); its verdicts are constants of the graph.
@constant_result
def _encoder_ran(seen: ForwardSeen) -> bool:
    seen.encoder_ran()
    return True


@constant_result
def _mask_built(seen: ForwardSeen, overlays: tuple) -> bool:
    seen.mask_built([Overlay(*o) for o in overlays])
    return True


@constant_result
def _layer_problem(checks: MultimodalChecks, module_name, config, causal, positions, blocks):
    return checks.problem(module_name, config, causal, positions, blocks)
