"""An exported ``config.json`` in the key form the installed transformers writes.

transformers 5.x writes RoPE as one ``rope_parameters`` table (``rope_type``,
``rope_theta`` and the scaling's keys) and the weights' dtype as ``dtype``; 4.x wrote
``rope_theta`` + ``rope_scaling`` and ``torch_dtype``. Both read either form, so usp's
own writer (:meth:`usp.models.LlamaConfig.to_hf_dict`) produces the 4.x form and
:func:`installed_form` turns it into what ``save_pretrained`` of the installed version
would write, as that version itself says (the keys of a default config of the model
type): an export then reads, and diffs, like a checkpoint saved by the user's own
transformers. Without transformers the 4.x form stays, except ``dtype`` where the
source checkpoint used that name.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KeyForm:
    rope_parameters: bool  # RoPE as one rope_parameters table (else rope_theta/rope_scaling)
    dtype_key: str  # "dtype" or "torch_dtype"


@functools.cache
def transformers_key_form(model_type: str) -> KeyForm | None:
    """How the installed transformers writes a ``model_type`` config (None: not installed,
    or the model type unknown to it)."""
    if importlib.util.find_spec("transformers") is None:
        return None
    try:
        from transformers import AutoConfig

        written = AutoConfig.for_model(model_type).to_dict()
    except (ImportError, ValueError, KeyError):
        return None
    return KeyForm(
        rope_parameters="rope_parameters" in written and "rope_theta" not in written,
        dtype_key="dtype" if "dtype" in written else "torch_dtype",
    )


def installed_form(config: dict[str, Any], *, source_keys=()) -> dict[str, Any]:
    """``config`` (4.x form: ``rope_theta``, ``rope_scaling``, ``torch_dtype``) in the
    installed transformers' key form; ``source_keys``: the source config.json's keys (its
    dtype key decides when transformers is absent)."""
    form = transformers_key_form(str(config.get("model_type", "")))
    if form is None:
        form = KeyForm(False, "dtype" if "dtype" in source_keys else "torch_dtype")
    out = dict(config)
    if form.rope_parameters and "rope_theta" in out:
        scaling = out.pop("rope_scaling", None) or {"rope_type": "default"}
        out["rope_parameters"] = {**scaling, "rope_theta": out.pop("rope_theta")}
    if form.dtype_key == "dtype" and "torch_dtype" in out:
        out["dtype"] = out.pop("torch_dtype")
    return out
