"""Tiny transformers vision-language models (Qwen3-VL and its MoE variant, Qwen3.5 with
images and videos, Gemma 3 with images) built from their config classes, and global
batches for them: text around image (and video) placeholders, with what each model's
processor would give (``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``,
``token_type_ids``, ...). Everything builds and runs on CPU in well under a second (no
hub downloads).
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 64
IMAGE, VIDEO, START, END = 60, 61, 62, 63  # placeholder and delimiter token ids
TEXT_TOKENS = 56  # random text tokens are below this
PATCH, MERGE, TEMPORAL = 2, 2, 2  # Qwen vision patches: 2x2 pixels, 2x2 merged, 2 frames

TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
)  # fmt: skip
MROPE = {"rope_type": "default", "rope_theta": 1000.0, "mrope_section": [2, 1, 1],
         "mrope_interleaved": True}  # fmt: skip
QWEN_VISION = dict(
    depth=2, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=PATCH,
    spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, out_hidden_size=32,
    num_position_embeddings=16,
)  # fmt: skip
QWEN_TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
                   vision_end_token_id=END)  # fmt: skip
GEMMA_IMAGE = 8  # pixels per side: 4x4 patches of 2, pooled to 2x2 = 4 tokens an image
GEMMA_TOKENS_PER_IMAGE = 4


def qwen3_vl_config(**text_changes):
    vision = dict(QWEN_VISION, deepstack_visual_indexes=[0])
    text = dict(TEXT, rope_parameters=MROPE, **text_changes)
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **QWEN_TOKENS)


def qwen3_vl_moe_config(**text_changes):
    vision = dict(QWEN_VISION, deepstack_visual_indexes=[0])
    text = dict(TEXT, rope_parameters=MROPE, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=16, decoder_sparse_step=1, **text_changes)  # fmt: skip
    return transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **QWEN_TOKENS)


def qwen3_5_config(**text_changes):
    text = dict(
        TEXT, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        rope_parameters=dict(MROPE, partial_rotary_factor=1.0), **text_changes,
    )  # fmt: skip
    return transformers.Qwen3_5Config(text_config=text, vision_config=QWEN_VISION, **QWEN_TOKENS)


def gemma3_config(**text_changes):
    text = dict(
        TEXT, query_pre_attn_scalar=8, sliding_window=6,
        layer_types=["sliding_attention", "full_attention"], **text_changes,
    )  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  image_size=GEMMA_IMAGE, patch_size=2)  # fmt: skip
    return transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA_TOKENS_PER_IMAGE,
        boi_token_index=START, eoi_token_index=END, image_token_index=IMAGE,
    )  # fmt: skip


CONFIGS = {
    "qwen3_vl": qwen3_vl_config, "qwen3_vl_moe": qwen3_vl_moe_config, "qwen3_5": qwen3_5_config,
    "gemma3": gemma3_config,
}  # fmt: skip
MODEL_CLASSES = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
}


def build(kind: str, *, attn_implementation: str = "sdpa", seed: int = 0, dtype=torch.float32):
    """A tiny model of ``kind`` with random weights (the same for the same seed), its
    norms moved off their initial values so that no gradient is trivially zero."""
    config = CONFIGS[kind]()
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[kind])._from_config(
        config, attn_implementation=attn_implementation, dtype=dtype
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.add_(0.2 * torch.randn_like(param))
    return model.train()


def batch(kind: str, parts, *, seed: int = 0) -> dict:
    """A global batch [1, S] of ``parts``: ints are runs of text tokens, ``("image", h, w)``
    an image of h x w patches (Gemma 3: one fixed-size image), ``("video", t, h, w)`` a
    video of t temporal patches (Qwen). Returns input_ids and the processor's outputs."""
    gen = torch.Generator().manual_seed(seed)
    ids, types, images, videos = [], [], [], []
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(0, TEXT_TOKENS, (part,), generator=gen).tolist()
            types += [0] * part
            continue
        if kind == "gemma3":
            n = GEMMA_TOKENS_PER_IMAGE
            images.append(torch.randn(3, GEMMA_IMAGE, GEMMA_IMAGE, generator=gen))
            ids += [START] + [IMAGE] * n + [END]
            types += [0] + [1] * n + [0]
            continue
        grid = (1, *part[1:]) if part[0] == "image" else tuple(part[1:])
        t, h, w = grid
        pixels = torch.randn(t * h * w, 3 * TEMPORAL * PATCH * PATCH, generator=gen)
        (images if part[0] == "image" else videos).append((grid, pixels))
        token, kind_id = (IMAGE, 1) if part[0] == "image" else (VIDEO, 2)
        for _ in range(t if part[0] == "video" else 1):  # Qwen: each frame delimited
            n = h * w // (MERGE * MERGE)
            ids += [START] + [token] * n + [END]
            types += [0] + [kind_id] * n + [0]
    out = {"input_ids": torch.tensor([ids])}
    if kind == "gemma3":
        out["token_type_ids"] = torch.tensor([types])
        if images:
            out["pixel_values"] = torch.stack(images)
        return out
    out["mm_token_type_ids"] = torch.tensor([types])
    if images:
        out["pixel_values"] = torch.cat([p for _, p in images])
        out["image_grid_thw"] = torch.tensor([g for g, _ in images])
    if videos:
        out["pixel_values_videos"] = torch.cat([p for _, p in videos])
        out["video_grid_thw"] = torch.tensor([g for g, _ in videos])
    return out


# ----------------------------------------------------------------------------- trainer data
#: Gemma 3's image tokens in the character-level vocabulary of trainer_cases (ids 60-63)
GEMMA_SPECIALS = {"<image_soft_token>": IMAGE, "<start_of_image>": START, "<end_of_image>": END}
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "{{ '<start_of_image>' }}{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def gemma3_processor():
    """A Gemma 3 processor for the tiny model: trainer_cases' characters, a newline, and
    Gemma 3's image tokens at the model's ids; 8 x 8 images of 4 tokens each."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from trainer_cases import CHARS, SPECIALS

    vocab = {token: i for i, token in enumerate([*SPECIALS, *CHARS, "\n"])}
    vocab.update(GEMMA_SPECIALS)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.add_special_tokens([*SPECIALS, *GEMMA_SPECIALS])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", extra_special_tokens={
            "image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>"},
    )  # fmt: skip
    tokenizer.chat_template = CHAT_TEMPLATE
    images = transformers.Gemma3ImageProcessorPil(
        size={"height": GEMMA_IMAGE, "width": GEMMA_IMAGE}, image_mean=[0.5] * 3,
        image_std=[0.5] * 3, do_pan_and_scan=False,
    )  # fmt: skip
    return transformers.Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE,
        image_seq_length=GEMMA_TOKENS_PER_IMAGE,
    )  # fmt: skip


def write_gemma3_checkpoint(directory, *, seed: int = 5):
    """The tiny Gemma 3 vision-language model and its processor, in one HF directory."""
    build("gemma3", seed=seed).save_pretrained(directory)
    gemma3_processor().save_pretrained(directory)
    return directory


def write_image_chats(path, count: int, *, seed: int = 0):
    """``count`` conversations about one image each (PNG files of 6 to 12 pixels a side
    beside ``path``), of different lengths, as TRL's vision-language records."""
    import json
    import random

    import numpy as np
    from PIL import Image
    from trainer_cases import WORDS

    rng = random.Random(seed)
    folder = path.parent / "images"
    folder.mkdir(exist_ok=True)
    rows = []
    for i in range(count):
        pixels = np.random.default_rng(seed * 1000 + i).integers(
            0, 256, (rng.randint(6, 12), rng.randint(6, 12), 3)
        )
        Image.fromarray(pixels.astype("uint8")).save(folder / f"{i}.png")
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3))) + "?"
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))) + "."
        rows.append({"images": [f"images/{i}.png"], "messages": [
            {"role": "user", "content": question}, {"role": "assistant", "content": answer}]})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
