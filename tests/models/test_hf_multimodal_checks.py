"""Vision-language models through the HF plug-in are exact or refused, never silently
wrong (issue 55, part 1): tiny Qwen3-VL, Qwen3.5 (multimodal) and Gemma 3 (multimodal)
with image inputs, against transformers' sdpa on the same weights.

* one process (``Plan(None)``): the model's own multimodal positions are exact; the
  batch's 1-D ``position_ids`` with images are refused (they would replace Qwen's t/h/w
  rows); Gemma 3's ``token_type_ids`` (bidirectional image blocks) are refused, not
  computed as causal; the vision towers run as the local encoders they are.
* under SP (4 gloo ranks): a forward that encodes images itself is refused with the
  same message about images on every rank, also when only one rank was given them, and
  the groups stay usable; Gemma 3's overlay is refused on every rank; Qwen3.5's text
  config gets the verdict of the swapped composite model (text-only batches are exact).
"""

from __future__ import annotations

import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import vl_cases
from reference import relative_error
from usp_cases import topology

transformers = pytest.importorskip("transformers", minversion="5.25")

import usp  # noqa: E402
from usp.models import hf as usp_hf  # noqa: E402
from usp.models import shard_batch  # noqa: E402
from usp.models.hf_inputs import HFInputError  # noqa: E402
from usp.models.hf_multimodal_checks import mask_overlays  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)

IMAGES = {  # a text run, an image, a text run (Qwen3.5 also a two-frame video)
    "qwen3_vl": [5, ("image", 4, 4), 7],
    "qwen3_5": [5, ("image", 4, 4), 3, ("video", 2, 2, 4), 4],
    "gemma3": [5, ("image",), 7],
}
POSITIONS_REFUSED = "rotates by multimodal positions"
BLOCKS_REFUSED = "token_type_ids make each image block bidirectional"
IMAGES_UNDER_SP = "encoded images .* under sequence parallelism"


def _quiet():
    warnings.simplefilter("ignore")  # transformers' slow-path notes (GDN on CPU)


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_one_process_exact_or_refused(kind):
    _quiet()
    name = usp_hf.register(None, name=f"usp_mm_checks_{kind}")
    reference = vl_cases.build(kind)
    model = vl_cases.build(kind, attn_implementation=name)
    inputs = vl_cases.batch(kind, IMAGES[kind])
    batch = shard_batch(None, inputs["input_ids"])
    media = {k: v for k, v in inputs.items() if k != "input_ids"}
    if kind == "gemma3":
        with pytest.raises(HFInputError, match=BLOCKS_REFUSED):
            model(**batch.hf_kwargs(), **media)
        media.pop("token_type_ids")  # images attended causally: what transformers does then
        inputs.pop("token_type_ids")
    else:
        with pytest.raises(HFInputError, match=POSITIONS_REFUSED):
            model(**batch.hf_kwargs(), **media)
    expected = reference(**inputs, use_cache=False).logits
    got = model(**inputs, use_cache=False).logits  # the model's own positions
    assert relative_error(got, expected) < 1e-5
    if kind == "gemma3":  # 1-D positions: the batch's are the model's
        assert relative_error(model(**batch.hf_kwargs(), **media).logits, expected) < 1e-5


def test_mask_overlays_read_from_transformers_mask_functions():
    from transformers import masking_utils as mu

    ids = torch.tensor([[-1, 0, 0, -1]])
    blocks = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids))
    assert mask_overlays(mu.causal_mask_function) == []
    assert mask_overlays(mu.sliding_window_causal_mask_function(4)) == []
    assert [o.adds for o in mask_overlays(blocks)] == [True]
    sliding_blocks = mu.and_masks(blocks, mu.sliding_window_overlay(4))
    assert [o.adds for o in mask_overlays(sliding_blocks)] == [True]

    def custom(b, h, q, kv):
        return kv != 0

    assert [o.adds for o in mask_overlays(mu.and_masks(mu.causal_mask_function, custom))] == [False]
    assert mask_overlays(mu.or_masks(mu.causal_mask_function, custom))[0].name.endswith("custom")


def run_refused_under_sp(kind: str, only_rank0: bool):
    _quiet()
    plan = usp.Plan(topology(2, 2))
    name = usp_hf.register(plan, name=f"usp_mm_sp_{kind}")
    model = vl_cases.build(kind, attn_implementation=name)
    inputs = vl_cases.batch(kind, [10, ("image", 4, 4), 10] if kind != "gemma3" else IMAGES[kind])
    seq = inputs["input_ids"].shape[1]
    inputs["input_ids"] = inputs["input_ids"][:, : seq - seq % 8]  # a whole zigzag layout
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in inputs:
            inputs[key] = plan.shard(inputs[key][:, : seq - seq % 8])
    batch = shard_batch(plan, inputs["input_ids"])
    media = {k: v for k, v in inputs.items() if k != "input_ids"}
    if only_rank0 and dist.get_rank() != 0:
        media = {}
    plan.sp_group.set_timeout(timedelta(seconds=30))  # a missed agreement fails fast
    try:
        model(**batch.hf_kwargs(), **media)
    except HFInputError as err:
        message = str(err)
    else:
        message = None
    finally:
        plan.sp_group.set_timeout(timedelta(seconds=600))
    check = torch.ones(1)
    dist.all_reduce(check, group=plan.sp_group)  # the group is still usable
    return message, float(check)


@pytest.mark.parametrize("only_rank0", [False, True])
def test_images_given_to_the_model_under_sp_are_refused_on_every_rank(distributed, only_rank0):
    results = distributed.run(run_refused_under_sp, "qwen3_vl", only_rank0, world_size=4)
    messages = [m for m, _ in results]
    assert all(m is not None for m in messages), messages
    assert all("shard_multimodal" in m and "encoded images" in m for m in messages)
    assert [c for _, c in results] == [4.0] * 4


def test_gemma3_blocks_given_to_the_model_under_sp_are_refused_on_every_rank(distributed):
    results = distributed.run(run_refused_under_sp, "gemma3", False, world_size=4)
    messages = [m for m, _ in results]
    assert all(m is not None and "encoded images" in m for m in messages), messages


def run_qwen3_5_text_under_sp():
    """The composite model registered after the GDN swap: its text config's calls get
    the swapped model's verdict (a text-only batch, exact against transformers)."""
    _quiet()
    plan = usp.Plan(topology(2, 2))
    name = usp_hf.register(plan, name="usp_mm_text35")
    reference = vl_cases.build("qwen3_5")
    model = vl_cases.build("qwen3_5", attn_implementation=name)
    ids = vl_cases.batch("qwen3_5", [16])["input_ids"]
    expected = reference(input_ids=ids, use_cache=False).logits
    assert usp_hf.swap_linear_attention(model, plan) == 1
    usp_hf.register(plan, name=name, model=model)
    batch = shard_batch(plan, ids)
    got = plan.gather(model(**batch.hf_kwargs()).logits)
    return relative_error(got, expected)


def test_qwen3_5_text_config_holds_the_swapped_models_verdict(distributed):
    errors = distributed.run(run_qwen3_5_text_under_sp, world_size=4)
    assert max(errors) < 1e-5, errors
