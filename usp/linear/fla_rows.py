"""usp's padded rows as one packed fla call, for every fla kernel usp runs (the gated
delta rule, simple GLA for Mamba-2, KDA).

usp computes a rank's segments as a padded batch ([N, L, ...], row i holding
``lengths[i]`` tokens, zeros after them). fla's chunk kernels take packed sequences
instead: one row [1, T, ...] of the valid tokens and ``cu_seqlens`` (int64, on the
tensors' device), one initial state per sequence, every sequence non-empty.
:func:`run_packed` maps one onto the other and back: no work on padding, an empty row
returns zeros and its initial state (zeros without one).
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["run_packed"]


def _packed_rows(lengths: list[int], length: int, device) -> torch.Tensor | None:
    """The flat row indices ([N * L] layout) of the valid tokens; None when every row
    is full (the padded tensor is then the packed one)."""
    if all(n == length for n in lengths):
        return None
    offsets = torch.arange(length)
    valid = offsets[None, :] < torch.tensor(lengths, dtype=torch.int64)[:, None]  # [N, L]
    return valid.reshape(-1).nonzero().squeeze(1).to(device)


def takes(fn, name: str) -> bool:
    """Whether ``fn``'s signature names ``name`` (False when it has none to read: pass
    only what every release takes)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def run_packed(fn, inputs, *, compute, lengths: list[int], initial_state, state_shape, **options):
    """``fn(*packed inputs, initial_state=..., output_final_state=True, cu_seqlens=...,
    **options)`` on the valid tokens of padded rows.

    ``inputs``: (tensor [N, L, ...], dtype fla gets it in) pairs in fla's order, the first
    q; ``initial_state`` [N, H, dk, dv] or None; ``state_shape`` (H, dk, dv) for the
    states of rows fla does not see. Returns (o [N, L, H, dv], final states
    [N, H, dk, dv]) in ``compute``."""
    first = inputs[0][0]
    n, length = first.shape[:2]
    device = first.device
    rows = _packed_rows(lengths, length, device)

    def packed(t, dtype):  # [N, L, ...] -> [1, T, ...]: the valid tokens, row after row
        flat = t.reshape(n * length, *t.shape[2:])
        return (flat if rows is None else flat.index_select(0, rows))[None].to(dtype)

    full = [i for i, count in enumerate(lengths) if count > 0]  # fla: no empty sequence
    if not full:  # no token at all: nothing to run
        state = initial_state
        if state is None:
            state = torch.zeros(n, *state_shape, dtype=compute, device=device)
        return torch.zeros(n, length, state_shape[0], state_shape[2], dtype=compute,
                           device=device), state  # fmt: skip
    bounds = [0]
    for i in full:
        bounds.append(bounds[-1] + lengths[i])
    h0 = initial_state
    if h0 is not None and len(full) < n:
        h0 = h0.index_select(0, torch.tensor(full, device=h0.device))
    if takes(fn, "cu_seqlens_cpu"):  # fla 0.6: the chunk indices without a host sync
        options["cu_seqlens_cpu"] = torch.tensor(bounds, dtype=torch.int64)
    o, final = fn(
        *(packed(t, dtype) for t, dtype in inputs),
        initial_state=h0,
        output_final_state=True,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int64, device=device),
        **options,
    )  # o [1, T, H, dv], final [len(full), H, dk, dv]
    o = o[0].to(compute)
    if rows is not None:
        o = o.new_zeros(n * length, *o.shape[1:]).index_copy(0, rows, o)
    final = final.to(compute)
    if len(full) < n:
        base = initial_state if initial_state is not None else final.new_zeros(n, *state_shape)
        final = base.index_copy(0, torch.tensor(full, device=final.device), final)
    return o.reshape(n, length, *o.shape[1:]), final
