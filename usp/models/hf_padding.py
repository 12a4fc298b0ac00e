"""The 2-D padding mask an HF model gives the USP attention plug-in, checked or refused.

A 2-D ``attention_mask`` reaches the model's mask builder, never the attention function.
:func:`padding_mask_function` is registered with the attention name in transformers'
``AttentionMaskInterface``: it sees the 2-D mask once per forward, refuses padding it
cannot compute exactly (anything but zeros at the end of each row of a causal model in
one process) and returns None, so no mask reaches the layers (the model never reads the
jumps of zigzag ``position_ids`` as documents). Eagerly the verdict is read on the host
(and agreed across the SP ranks); inside a compiled graph the same rule is checked on
the device (:func:`padding_in_graph`).
"""

from __future__ import annotations

import torch

from usp.comm import traced
from usp.comm.agreement import agree, can_agree
from usp.errors import InputError

_FIX_PADDING = (
    "pad at the end of each row and give the pads the ignore label -100 (or no mask at "
    "all), or pack the rows into one sequence: HF padding-free "
    "(DataCollatorWithFlattening / TRL padding_free=True) or usp_packed=plan.pack(cu)"
)


class HFInputError(InputError):
    """An input of an HF model with USP attention that the plug-in cannot compute exactly."""


# ----------------------------------------------------------------------------- padding
_SP_PADDING = (
    "an attention_mask with zeros under sequence parallelism (each rank holds a shard "
    "of the sequence, so padding cannot be placed); pass no mask: "
    + _FIX_PADDING.replace("each row", "the global sequence")
)
_BIDIRECTIONAL_PADDING = (
    "an attention_mask with zeros in a bidirectional model (is_causal=False): every "
    "real token would attend to the pads; give rows without padding, or pack the rows "
    "into one sequence: HF padding-free (DataCollatorWithFlattening) or "
    "usp_packed=plan.pack(cu)"
)
_LEFT_PADDING = (
    "an attention_mask with padding before real tokens ({where}left padding or "
    f"holes); USP attention applies no padding mask, so {_FIX_PADDING}. For "
    "generation, run the rows one at a time or use attn_implementation='sdpa'"
)


def _mask_rule(plan, attention_mask: torch.Tensor, causal: bool):
    """(the mask as bools, the padding this call may have, the problem otherwise): "none"
    under SP or in a bidirectional model, "right" (zeros at the ends of rows) otherwise."""
    if attention_mask.dim() != 2:
        return (
            None,
            None,
            f"attention_mask of shape {tuple(attention_mask.shape)} (expected [B, S])",
        )
    mask = attention_mask.bool()
    if plan.sp_degree > 1:
        return mask, "none", _SP_PADDING
    if not causal:
        return mask, "none", _BIDIRECTIONAL_PADDING
    return mask, "right", _LEFT_PADDING


def _left_padding(mask: torch.Tensor) -> torch.Tensor:
    """[B, S] bool -> [B, S-1]: a real token right after a pad (left padding or holes)."""
    return mask[:, 1:] & ~mask[:, :-1]


def padding_problem(plan, attention_mask: torch.Tensor, *, causal: bool) -> str | None:
    """Why the 2-D padding mask [B, S] (True: a real token) cannot be served, or None.

    Exact without a mask: no zeros; or, for a causal model in one process, zeros only
    at the end of each row (no real token attends to a later one). One host sync."""
    mask, allowed, problem = _mask_rule(plan, attention_mask, causal)
    if mask is None:
        return problem
    if bool(mask.all()):
        return None
    if allowed == "none":
        return problem
    later_token = _left_padding(mask)  # [B, S-1]
    if bool(later_token.any()):
        row = int(later_token.any(dim=1).nonzero()[0])
        return problem.format(where=f"row {row}: ")
    return None


def padding_in_graph(plan, name: str, attention_mask: torch.Tensor, causal: bool):
    """:func:`padding_problem` inside a compiled graph: the same rule checked on the
    device (the graph raises the message, on every SP rank alike; without the row); the
    mask's shape is checked while tracing. Returns whether the mask has zeros (a bool
    tensor)."""
    mask, allowed, problem = _mask_rule(plan, attention_mask, causal)
    if mask is None:
        raise HFInputError(_padding_message(name, problem))
    all_real = mask.all()
    ok = all_real if allowed == "none" else ~_left_padding(mask).any()
    traced.require(ok, _padding_message(name, problem.format(where="")), plan.traced_sp_group)
    return ~all_real


def window_problem(
    plan, local_size, kv_length, kv_offset, *, bidirectional_window: int | None = None
) -> str | None:
    """Why a mask of attention limited to ``local_size`` tokens cannot be served, or None.

    transformers' chunked masks (``create_chunked_causal_mask``) and the bidirectional
    sliding window give the mask function ``local_size``; USP attention computes neither
    (its windows are causal sliding windows, :func:`sliding_causal`), so it is exact only
    when the window holds the whole (global) sequence. ``bidirectional_window``: the
    config's ``sliding_window`` when the mask is the bidirectional sliding window of a
    model set ``is_causal=False`` (the message says so). Shapes and the config only: the
    same on every rank, and a plain Python check under ``torch.compile`` too."""
    if local_size is None:
        return None
    total = (kv_offset + kv_length) * plan.sp_degree
    if local_size >= total:
        return None
    if bidirectional_window is not None and local_size == bidirectional_window:
        return (
            f"is_causal=False with sliding_window={local_size} (a bidirectional sliding "
            f"window) for a sequence of {total} tokens; USP attention computes sliding "
            "windows of causal attention (and full bidirectional attention) only: leave "
            "is_causal at True for this causal LM, give sequences of at most "
            f"{local_size} tokens, or use attn_implementation='sdpa'"
        )
    return (
        f"a mask of attention limited to {local_size} tokens (a sliding-window or chunked "
        f"attention layer: config.sliding_window / attention_chunk_size) for a sequence of "
        f"{total} tokens; USP attention computes full causal or bidirectional attention "
        f"only: give sequences of at most {local_size} tokens or use attn_implementation='sdpa'"
    )


def sliding_causal(local_size, config, mask_kwargs) -> bool:
    """Whether a mask limited to ``local_size`` tokens is transformers' causal sliding
    window (``create_sliding_window_causal_mask``: the config's ``sliding_window``, not an
    attention chunk, and not the bidirectional builder, which alone passes
    ``allow_is_bidirectional_skip``): its layers hand the attention function
    ``sliding_window``, which USP attention computes."""
    if local_size is None or "allow_is_bidirectional_skip" in mask_kwargs:
        return False
    if local_size == getattr(config, "attention_chunk_size", None):
        return False
    return local_size == getattr(config, "sliding_window", None)


class PaddingSeen:
    """What the mask builders of the current forward asked for, set by the mask function
    before the layers run. ``padded``: whether the 2-D mask had (right) padding (the
    attention function refuses it for a layer that turns out to be bidirectional); a
    bool, or inside a compiled graph a bool tensor (checked on the device,
    :meth:`refuse_if_padded`). ``mask_kinds``: the kinds of mask ("causal",
    "bidirectional") built for the layers that follow (the mask calls since the last
    attention call: an encoder's and a decoder's masks are told apart)."""

    def __init__(self):
        self.padded = False
        self.mask_kinds: frozenset[str] = frozenset()
        self._closed = True  # an attention call (or a refusal) came after the last mask call

    def mask_built(self, kind: str) -> None:
        kinds = frozenset() if self._closed else self.mask_kinds
        self.mask_kinds, self._closed = kinds | {kind}, False

    def close_group(self) -> None:
        """An attention call (or a refusal) ends the group of mask calls before it."""
        self._closed = True

    def causal(self, module, is_causal: bool | None, name: str) -> bool:
        """Whether ``module``'s attention call is causal, as transformers decides it: the
        keyword, else ``module.is_causal``; a config with ``is_causal=False`` makes the
        model bidirectional whatever the module says. A module marked ``is_causal=False``
        that is given a mask follows the mask, as eager attention does (the mask wins):
        causal when the forward built causal masks only (BigBird-Pegasus's decoder),
        refused when it built both kinds (which one reaches this layer cannot be told
        here: usp's mask function builds no mask)."""
        if is_causal is not None:
            return bool(is_causal)
        config = getattr(module, "config", None)
        causal = bool(getattr(module, "is_causal", True))
        causal = causal and bool(getattr(config, "is_causal", True))
        if causal or self.mask_kinds in (frozenset(), frozenset({"bidirectional"})):
            return causal
        if self.mask_kinds == {"causal"}:
            return True
        self.close_group()
        raise HFInputError(
            f"attn_implementation={name!r} (USP attention): {type(module).__name__} is marked "
            "is_causal=False, and this forward built both causal and bidirectional masks, so "
            "usp cannot tell which of them this layer is given (usp's mask function builds "
            "no mask; transformers would apply the one the model passes). Either way could "
            "be silently wrong: use attn_implementation='sdpa' or 'eager' for this model"
        )

    def refuse_if_padded(self, plan, message: str) -> None:
        if isinstance(self.padded, torch.Tensor):  # compiled: the mask's verdict on the device
            traced.require(~self.padded, message, plan.traced_sp_group)
        elif self.padded:
            raise HFInputError(message)


def padding_mask_function(plan, name: str, seen: PaddingSeen, check_model=None):
    """The mask function registered with attention ``name``: checks the 2-D padding mask
    (once per forward) and returns None, so the layers get no mask. Under SP the ranks
    agree on the verdict, so a refusal is raised on every rank. A mask built with
    transformers' bidirectional mask function counts as non-causal whatever the config.
    A chunked or bidirectional sliding-window mask whose window is shorter than the
    sequence is refused (a causal sliding window is computed by the attention call)
    (:func:`window_problem`). ``check_model(config)``, when given, first checks the model
    behind the config (:class:`usp.models.hf_mixers.MixerCheck`)."""
    from transformers.masking_utils import bidirectional_mask_function

    def usp_padding_mask(*args, **kwargs):
        try:
            return checked_mask(*args, **kwargs)
        except Exception:
            seen.close_group()  # a refused forward: the next mask call starts a new one
            raise

    def checked_mask(*args, attention_mask=None, config=None, mask_function=None, **kwargs):
        if check_model is not None:
            check_model(config)
        problem = None
        seen.padded = False
        local_size = kwargs.get("local_size")
        if sliding_causal(local_size, config, kwargs):
            local_size = None  # the attention call gets sliding_window and computes it
        bidirectional_window = None
        if "allow_is_bidirectional_skip" in kwargs:  # the bidirectional builders
            bidirectional_window = getattr(config, "sliding_window", None)
        # the same on every rank (shapes and config): no agreement needed
        window = window_problem(
            plan,
            local_size,
            kwargs.get("kv_length", 0),
            kwargs.get("kv_offset", 0),
            bidirectional_window=bidirectional_window,
        )
        if window is not None:
            raise HFInputError(_padding_message(name, window))
        causal = bool(getattr(config, "is_causal", True))
        causal = causal and mask_function is not bidirectional_mask_function
        # transformers' bidirectional builders alone pass allow_is_bidirectional_skip
        bidirectional = "allow_is_bidirectional_skip" in kwargs or not causal
        seen.mask_built("bidirectional" if bidirectional else "causal")
        if torch.compiler.is_compiling():  # checked on the device, no host sync
            if attention_mask is not None:
                seen.padded = padding_in_graph(plan, name, attention_mask, causal)
            return None
        if attention_mask is not None:
            problem = padding_problem(plan, attention_mask, causal=causal)
            seen.padded = problem is None and not bool(attention_mask.bool().all())
        group = plan.sp_group  # None in one process (sp_degree 1)
        if attention_mask is not None and plan.sp_degree > 1 and can_agree(group):
            error = None if problem is None else HFInputError(_padding_message(name, problem))
            agree(group, f"attn_implementation={name!r}", [], error, (HFInputError,))
        if problem is not None:
            raise HFInputError(_padding_message(name, problem))
        return None

    usp_padding_mask.usp_mask_for = name  # marks it as usp's (register may replace it)
    usp_padding_mask.usp_check = check_model  # what models built with the name meet
    return usp_padding_mask


def _padding_message(name: str, problem: str) -> str:
    return f"attn_implementation={name!r} (USP attention) got {problem}"
