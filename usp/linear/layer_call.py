"""What every usp mixer layer (the modules :func:`usp.models.hf.swap_linear_attention`
puts in place of transformers') does with the keywords of its call: it computes training
forwards (no cache), takes no padding (documents are packed instead), and reads the
documents from ``packed=`` or from the keywords a decoder layer passes on: ``usp_packed``
(the HF plug-in's) or ``cu_seq_lens_q`` (transformers' padding-free batches)."""

from __future__ import annotations

__all__ = ["call_documents"]


def call_documents(layer: str, cache, attention_mask, packed, kwargs: dict):
    """The documents of a call of ``layer`` (its class name): ``packed``, else
    ``usp_packed`` / ``cu_seq_lens_q`` of ``kwargs``, else None. Raises ``ValueError``
    for a cache or a padding mask."""
    if cache is not None:
        raise ValueError(f"{layer} (usp) computes training forwards: pass use_cache=False")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(f"{layer} (usp) does not take padding; pack documents instead")
    if packed is None:
        packed = kwargs.get("usp_packed", kwargs.get("cu_seq_lens_q"))
    return packed
