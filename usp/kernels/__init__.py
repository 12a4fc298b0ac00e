"""Local attention kernels that return the log-sum-exp, with a matching backward.

One interface, several backends (``cudnn``, ``flash_attn``, ``flash``, ``efficient``,
``cpu``, ``math``), chosen per call; ``backend="auto"`` picks the fastest that supports
the call. See ``usp/kernels/spec.py`` for shapes and masking semantics.
"""

from usp.kernels.api import attention_backward, attention_forward, select_backend
from usp.kernels.backends.registry import BACKEND_NAMES
from usp.kernels.merge import merge_into, merge_pair
from usp.kernels.spec import AttentionInputError, AttentionSpec, BackendUnavailableError
from usp.kernels.varlen import attention_varlen_backward, attention_varlen_forward

__all__ = [
    "BACKEND_NAMES",
    "AttentionInputError",
    "AttentionSpec",
    "BackendUnavailableError",
    "attention_backward",
    "attention_forward",
    "attention_varlen_backward",
    "attention_varlen_forward",
    "merge_into",
    "merge_pair",
    "select_backend",
]
