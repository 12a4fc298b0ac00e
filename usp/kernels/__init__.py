"""Local attention kernels that return the log-sum-exp, with a matching backward.

One interface, several backends (``cudnn``, ``flash_attn``, ``flash``, ``efficient``,
``cpu``, ``math``), chosen per call; ``backend="auto"`` picks the fastest that supports
the call and says (``usp.kernels`` logger, a warning for a failed backend) what it
skipped. See ``usp/kernels/spec.py`` for shapes, masking and NaN semantics.

Distributed callers validate a call before their first collective with
:func:`validate_inputs`, :func:`select_backend` and :func:`default_scale` (or
:func:`prepare_call`, all three), which raise the errors a kernel call would, without
running a kernel, and then run it with :func:`dense_forward`/:func:`docs_forward` (the
dispatcher: no validation, no selection).

Modules, each importing only modules listed before it: ``spec`` (validation),
``masks``, ``merge``, ``docs`` (packed boundaries), ``backends/base`` (the interface),
``backends/math``, ``backends/cpu``, ``backends/cuda_common``, ``backends/sdpa_cuda``,
``dispatch``, ``selfcheck``, ``backends/flash_attn`` (vets each FA generation),
``backends/registry``, ``selection``, ``api`` and ``varlen`` (the public entry points),
``ops`` (custom ops for ``torch.compile``).
"""

from usp.kernels.api import attention_backward, attention_forward, prepare_call
from usp.kernels.backends.base import BackendFailure
from usp.kernels.backends.registry import BACKEND_NAMES
from usp.kernels.dispatch import dense_backward, dense_forward, docs_backward, docs_forward
from usp.kernels.docs import PackedDocs
from usp.kernels.merge import merge_into, merge_pair
from usp.kernels.selection import MATH_AUTO_MAX_SCORES, select_backend, unsupported_reason
from usp.kernels.spec import (
    AttentionInputError,
    AttentionSpec,
    BackendUnavailableError,
    default_scale,
    validate_inputs,
)
from usp.kernels.varlen import (
    attention_varlen_backward,
    attention_varlen_forward,
    packed_backward,
    packed_forward,
)

__all__ = [
    "BACKEND_NAMES",
    "MATH_AUTO_MAX_SCORES",
    "AttentionInputError",
    "AttentionSpec",
    "BackendFailure",
    "BackendUnavailableError",
    "PackedDocs",
    "attention_backward",
    "attention_forward",
    "attention_varlen_backward",
    "attention_varlen_forward",
    "default_scale",
    "dense_backward",
    "dense_forward",
    "docs_backward",
    "docs_forward",
    "merge_into",
    "merge_pair",
    "packed_backward",
    "packed_forward",
    "prepare_call",
    "select_backend",
    "unsupported_reason",
    "validate_inputs",
]
