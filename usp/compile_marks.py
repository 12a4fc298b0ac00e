"""torch.compile's function marks, applied without loading torch's compiler.

``torch._dynamo`` (and with it ``torch._inductor``, sympy and parts of torch.onnx) takes
1-2 s of CPU to import; a module-level ``@torch._dynamo.assume_constant_result`` or
``@torch.compiler.disable`` loads it in every process that imports usp, compiled or not
(each rank of the attention demo spent 5.4 s of CPU instead of 3.3 s). These marks have
the same effect under ``torch.compile`` and load nothing at import:

- :func:`constant_result` sets the attribute that ``torch._dynamo.assume_constant_result``
  sets (tests/tools/test_compile_marks.py checks that torch's decorator still sets exactly
  that, and that a marked function's result is a constant of the traced graph);
- :func:`compiler_disabled` is torch's own lazy ``torch._dynamo.disable`` (the one torch
  puts on ``DTensor.__new__``): the compiler loads on the first call.

A leaf module (torch only): any part of usp can mark its functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

#: the attribute torch._dynamo.assume_constant_result sets (torch 2.6 to 2.13)
CONSTANT_RESULT_ATTRIBUTE = "_dynamo_marked_constant"


def constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``: while a graph is traced, ``fn`` runs
    eagerly once and its result is a constant of the graph."""
    setattr(fn, CONSTANT_RESULT_ATTRIBUTE, True)
    return fn


def compiler_disabled(fn: F) -> F:
    """``torch.compiler.disable(fn)``: never traced (a compiled caller breaks its graph
    and calls ``fn`` eagerly), with torch's compiler imported on the first call."""
    return torch._disable_dynamo(fn)
