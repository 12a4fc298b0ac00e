"""LoRA dropout whose mask does not depend on how the tokens are sharded.

``nn.Dropout`` draws its mask from the rank's random generator, so under sequence
parallelism (each rank holds other tokens, in the layout's order) or data parallelism
(another split of the global batch into replicas and micro-batches) the masks -- and so
the losses and gradients -- differ from one process's. Here the mask of one element is a
pure function of where its token sits in the training data and of the module:

    u    = token * features + feature                 (int64; token: the data-stream index)
    bits = splitmix64(u XOR salt)                      (salt: from [train] seed and the module)
    keep = (bits >> 40) >= round(p * 2**24)            (the top 24 bits against p)

``token`` is the token's index in the training data stream (the loader's global sequence
index times ``seq_len`` plus the token's offset in its sequence: see
:func:`usp.models.lora.set_stream_position`), so every token of every step gets its own
mask, the same on one process and on any grid, micro-batching and resume. ``p`` is
quantised to a multiple of 2**-24; kept elements are scaled by ``1 / (1 - p)`` as
``nn.Dropout`` scales them. The masks are not ``nn.Dropout``'s (that is impossible without
one generator stream in one order): their distribution is (i.i.d. Bernoulli(1 - p) per
element, up to the hash's quality), and ``tests/models/test_lora.py`` checks the formula
against an independent Python implementation and the drop rate.

:func:`keep_mask` computes the mask in tiles of rows (the int64 temporaries exist for one
tile at a time: memory-periodic, :mod:`usp.models.tiling`); autograd keeps the bool mask.
"""

from __future__ import annotations

import torch

from usp.models.tiling import representative, tiles

_BITS = 64
_MASK64 = (1 << _BITS) - 1
#: splitmix64's constants (Steele, Lea, Flood 2014), as signed int64 values
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
#: the mask compares the top 24 bits of the hash with p * 2**24
THRESHOLD_BITS = 24
#: elements whose int64 temporaries one tile of :func:`keep_mask` holds at most
_TILE_ELEMENTS = 1 << 20


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    value &= _MASK64
    return value - (1 << _BITS) if value >> (_BITS - 1) else value


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (_BITS - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps modulo 2**64)."""
    x = (x ^ _shift_right(x, 30)) * _signed(_MIX1)
    x = (x ^ _shift_right(x, 27)) * _signed(_MIX2)
    return x ^ _shift_right(x, 31)


def _mix_int(x: int) -> int:
    """:func:`_mix` on one Python integer (for the salts)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def module_salt(seed: int, module_index: int) -> int:
    """The salt of the ``module_index``-th adapted module of a run seeded ``seed``."""
    return _signed(_mix_int(_mix_int(seed * _GOLDEN) + (module_index + 1) * _GOLDEN))


def drop_threshold(p: float) -> int:
    """``p`` as the count of 24-bit values below which an element is dropped."""
    return round(p * (1 << THRESHOLD_BITS))


def keep_mask(tokens: torch.Tensor, features: int, p: float, salt: int) -> torch.Tensor:
    """tokens int64 [rows] (data-stream indices) -> bool [rows, features]: True where an
    element is kept (see the module docstring)."""
    rows = tokens.shape[0]
    keep = torch.empty((rows, features), dtype=torch.bool, device=tokens.device)
    columns = torch.arange(features, dtype=torch.int64, device=tokens.device)
    threshold = drop_threshold(p)
    chunk = max(1, _TILE_ELEMENTS // max(features, 1))
    for part in tiles(rows, chunk, representative_only=representative(tokens)):
        u = tokens[part, None] * features + columns  # [tile, features]
        bits = _mix(u ^ salt)
        torch.ge(_shift_right(bits, _BITS - THRESHOLD_BITS), threshold, out=keep[part])
    return keep


def apply_mask(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """x [..., features] with the elements ``keep`` [rows, features] (rows = x's leading
    dims flattened) does not keep set to 0 and the others scaled by 1 / (1 - p)."""
    keep = keep.view(x.shape)
    return torch.where(keep, x * (1.0 / (1.0 - p)), x.new_zeros(()))
