"""What :func:`usp.models.hf.shard_multimodal` reads of each vision-language family.

A family says which processor outputs it takes, how its media split into **units** (an
image; a video's temporal patches, each its own attention sequence in the Qwen towers:
the work spread over the SP ranks), how its encoder turns a unit's pixels into the
features of its placeholder tokens (with Qwen3-VL's deepstack features as more columns),
what the model's forward takes instead of pixels (``mm_encoder_outputs``), and its
positions (Qwen's t/h/w rows from the model's own ``get_rope_index``, per document).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from usp.models.hf_padding import HFInputError


@dataclass(frozen=True)
class Unit:
    """One piece of the encoder's work: ``kind`` ("image" or "video"), rows [start, end)
    of its pixel tensor, its (t, h, w) grid (Qwen), the placeholder tokens it fills and
    its cost (patches)."""

    kind: str
    rows: tuple[int, int]
    grid: tuple[int, int, int] | None
    tokens: int
    cost: int


PIXEL_KEYS = {"image": "pixel_values", "video": "pixel_values_videos"}
GRID_KEYS = {"image": "image_grid_thw", "video": "video_grid_thw"}


class QwenVL:
    """Qwen3-VL (and its MoE variant) and Qwen3.5 (images and videos; Qwen3-VL's
    deepstack features)."""

    model_types = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5")
    media_keys = (
        "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw",
        "mm_token_type_ids",
    )  # fmt: skip
    type_key = "mm_token_type_ids"
    kind_types = {"image": 1, "video": 2}

    def __init__(self, config):
        self.config = config
        self.merge = config.vision_config.spatial_merge_size
        self.deepstack = len(getattr(config.vision_config, "deepstack_visual_indexes", ()) or ())

    def token_ids(self) -> dict[str, int]:
        return {"image": self.config.image_token_id, "video": self.config.video_token_id}

    def feature_dim(self) -> int:
        return self.config.text_config.hidden_size * (1 + self.deepstack)

    def units(self, outputs: dict) -> list[Unit]:
        """Images whole; videos by temporal patch (frame), each an attention sequence
        of the tower of its own (``get_vision_attention_seqlens``)."""
        found = []
        for kind in ("image", "video"):
            pixels, grids = outputs.get(PIXEL_KEYS[kind]), outputs.get(GRID_KEYS[kind])
            if (pixels is None) != (grids is None):
                raise HFInputError(
                    f"{PIXEL_KEYS[kind]} and {GRID_KEYS[kind]} come together (the processor "
                    "gives both): one of them is missing"
                )
            if pixels is None:
                continue
            start = 0
            for t, h, w in grids.tolist():
                for _ in range(t if kind == "video" else 1):
                    frames = 1 if kind == "video" else t
                    patches = frames * h * w
                    grid = (frames, h, w)
                    tokens = patches // (self.merge * self.merge)
                    found.append(Unit(kind, (start, start + patches), grid, tokens, patches))
                    start += patches
            if start != pixels.shape[0]:
                raise HFInputError(
                    f"{GRID_KEYS[kind]} {grids.tolist()} describe {start} patches but "
                    f"{PIXEL_KEYS[kind]} has {pixels.shape[0]} rows"
                )
        return found

    def encode(self, model, kind: str, pixels: torch.Tensor, units: list[Unit]) -> torch.Tensor:
        """This rank's units of ``kind`` -> their features [tokens, hidden * (1 +
        deepstack)] (the encoder's merged output, then its deepstack features)."""
        encode = model.get_image_features if kind == "image" else model.get_video_features
        grids = torch.tensor([u.grid for u in units], device=pixels.device)
        out = encode(pixels, grids, return_dict=True)
        pooled = torch.cat(out.pooler_output)
        deep = [torch.cat(f) for f in (getattr(out, "deepstack_features", None) or [])]
        return torch.cat([pooled, *deep], dim=-1)

    def encoders(self, model) -> list:
        """The modules that turn pixels into features (their parameters' gradients)."""
        return [_base(model).visual]

    def encoder_output(self, features: torch.Tensor):
        """What the forward's ``mm_encoder_outputs`` holds for this rank's tokens."""
        hidden = self.config.text_config.hidden_size
        pooled, *deep = features.split(hidden, dim=-1)
        if not self.deepstack:
            from transformers.modeling_outputs import BaseModelOutputWithPooling

            return BaseModelOutputWithPooling(pooler_output=(pooled,))
        from transformers.models.qwen3_vl.modeling_qwen3_vl import (
            BaseModelOutputWithDeepstackFeatures,
        )

        return BaseModelOutputWithDeepstackFeatures(
            pooler_output=(pooled,), deepstack_features=[(d,) for d in deep]
        )

    def positions(self, model, input_ids, outputs: dict, bounds) -> torch.Tensor:
        """The model's t/h/w rows [3, B, S] over the global sequence (``get_rope_index``),
        document by document when packed (``bounds``: global boundaries, B = 1)."""
        types = outputs.get(self.type_key)
        if types is None:
            raise HFInputError(
                "mm_token_type_ids are missing: the model computes its multimodal positions "
                "from them (the processor returns them with input_ids)"
            )
        rope_index = _base(model).get_rope_index
        grids = {kind: outputs.get(GRID_KEYS[kind]) for kind in ("image", "video")}
        if bounds is None:
            return rope_index(input_ids, mm_token_type_ids=types,
                              image_grid_thw=grids["image"], video_grid_thw=grids["video"])[0]  # fmt: skip
        queues = {kind: list(g) if g is not None else [] for kind, g in grids.items()}
        rows = []
        for a, b in zip(bounds, bounds[1:]):
            doc_types = types[:, a:b]
            doc_grids = {
                kind: _take(queues[kind], _runs(doc_types, code), kind)
                for kind, code in self.kind_types.items()
            }  # fmt: skip
            rows.append(rope_index(input_ids[:, a:b], mm_token_type_ids=doc_types,
                                   image_grid_thw=doc_grids["image"],
                                   video_grid_thw=doc_grids["video"])[0])  # fmt: skip
        return torch.cat(rows, dim=-1)


class Gemma3:
    """Gemma 3 (images; ``token_type_ids`` make each image block bidirectional)."""

    model_types = ("gemma3",)
    media_keys = ("pixel_values", "token_type_ids")
    type_key = "token_type_ids"

    def __init__(self, config):
        self.config = config

    def token_ids(self) -> dict[str, int]:
        return {"image": self.config.image_token_id}

    def feature_dim(self) -> int:
        return self.config.text_config.hidden_size

    def units(self, outputs: dict) -> list[Unit]:
        pixels = outputs.get("pixel_values")
        if pixels is None:
            return []
        tokens = self.config.mm_tokens_per_image
        return [Unit("image", (i, i + 1), None, tokens, 1) for i in range(pixels.shape[0])]

    def encode(self, model, kind: str, pixels: torch.Tensor, units: list[Unit]) -> torch.Tensor:
        out = model.get_image_features(pixels, return_dict=True)
        return out.pooler_output.reshape(-1, out.pooler_output.shape[-1])  # [n * tokens, D]

    def encoders(self, model) -> list:
        base = model.model if hasattr(model, "model") else model
        return [base.vision_tower, base.multi_modal_projector]

    def encoder_output(self, features: torch.Tensor):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        return BaseModelOutputWithPooling(pooler_output=features)

    def positions(self, model, input_ids, outputs, bounds):
        return None  # 1-D positions: the batch's


FAMILIES = (QwenVL, Gemma3)


def family_of(model):
    """The family adapter of ``model`` (a transformers vision-language model)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family(config)
    supported = ", ".join(t for f in FAMILIES for t in f.model_types)
    raise HFInputError(
        f"usp.models.hf.shard_multimodal does not know {type(model).__name__} (model_type "
        f"{model_type!r}); it computes {supported}. Other vision-language models: train "
        "them in one process (Plan(None)) with their own inputs"
    )


def _base(model):
    """The model that owns ``get_rope_index`` (the ForConditionalGeneration's ``model``)."""
    return model if hasattr(model, "get_rope_index") else model.model


def _runs(types: torch.Tensor, code: int) -> int:
    """How many runs of ``code`` a [1, L] row has (each an image, or a video's frame)."""
    flags = types[0].eq(code).to(torch.int8)
    return int((torch.diff(flags, prepend=flags.new_zeros(1)) == 1).sum())


def _take(queue: list, runs: int, kind: str):
    """The grids a document's ``runs`` use, taken from the front of ``queue`` (a video's
    frames are runs of its own: its grid goes when all its frames are in the document)."""
    taken, covered = [], 0
    while covered < runs:
        if not queue:
            raise HFInputError(f"the documents hold more {kind} runs than {kind} grids were given")
        grid = queue.pop(0)
        taken.append(grid)
        covered += int(grid[0]) if kind == "video" else 1
    if covered != runs:
        raise HFInputError(
            f"a {kind} is split between two packed documents (its frames in both): keep each "
            "video inside one document"
        )
    return torch.stack(taken) if taken else None
