"""Autograd inside a ``torch.library`` op's implementation.

An op whose backward is another op that recomputes the forward under autograd (the Gated
DeltaNet ring block's :mod:`usp.linear.compiled`; the MoE experts' :mod:`usp.models.moe_op`
has its own copy of this guard, to be replaced by this one) runs below the dispatcher's
autograd keys: without :func:`autograd_dispatch` the recomputed forward records no graph
to differentiate.
"""

from __future__ import annotations

import torch

__all__ = ["autograd_dispatch"]

_AUTOGRAD_KEYS = tuple(
    getattr(torch._C.DispatchKey, name)
    for name in (
        "AutogradFunctionality",
        "AutogradCPU",
        "AutogradCUDA",
        "AutogradOther",
        "AutogradNestedTensor",
        "ADInplaceOrView",
    )
)


def autograd_dispatch():
    """Autograd dispatch back on inside an op's implementation (the dispatcher runs it
    below autograd). The other excluded keys (autocast) stay excluded. (torch has no
    public guard for this.)"""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)
