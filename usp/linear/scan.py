"""A linear recurrence with one scalar decay per head and token, in torch (chunked): the
scan of Mamba-2's state space duality (SSD), in the form fla calls simple GLA.

Per head, with a state ``S`` of [d_k, d_v] (Mamba-2: d_k the state size N, d_v the head
dim P), for every token t::

    S <- exp(g_t) S + k_t v_t^T
    o_t = S^T q_t

Mamba-2 maps onto it with q = C, k = B (its groups expanded to heads), v = dt x and
g = dt A (:mod:`usp.linear.mamba2`). The chunked form (chunk length c, gamma = cumsum(g)
inside the chunk)::

    O   = (Q K^T * exp(gamma_t - gamma_s) [s <= t]) V + diag(exp(gamma)) Q S0
    S_c = exp(gamma_c) S0 + K^T diag(exp(gamma_c - gamma)) V

Every factor but the last two lines is computed for all chunks at once; the loop over
chunks is two matmuls a chunk. Every exponent is <= 0 (g <= 0), so nothing overflows.
Autograd gives the backward.

Rows are independent segments in the padded layout of :func:`usp.linear.kernel.to_padded`
([N, L, H, D], zeros after a row's end): a zero key with g = 0 leaves the state as it was,
so a row's final state is exact whatever its padding. Precision: float64 computes in
float64, everything else in float32 (the caller casts; no casts here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from usp.planning_mode import planned_gradients, representative

__all__ = ["chunk_loop", "scalar_decay_padded"]


def scalar_decay_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked recurrence on independent rows from a zero state, in the compute dtype
    already (q scaled by the caller when it is to be).

    q, k [N, L, H, dk]; v [N, L, H, dv]; g (log decay, <= 0) [N, L, H]. Returns
    (o [N, L, H, dv], final state [N, H, dk, dv]). ``chunk_size`` is bounded by L (a
    longer chunk only pads the rows with [C, C] work, for the same result)."""
    n, length, heads, dk = k.shape
    dv = v.shape[-1]
    c = max(1, min(chunk_size, length))
    pad = (-length) % c
    if pad:  # zero keys and g = 0 after the end: the state is left as it was
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad))
    chunks = (length + pad) // c

    def chunked(t):  # [N, L, H, ..] -> [N, H, n_chunks, C, ..]
        return t.transpose(1, 2).reshape(n, heads, chunks, c, *t.shape[3:])

    q, k, v, g = (chunked(t) for t in (q, k, v, g))
    gamma = g.cumsum(-1)  # [N, H, n, C]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    inner = ((q @ k.transpose(-1, -2)) * decay) @ v  # [N, H, n, C, dv]: from a zero state
    q_decay = q * gamma.exp()[..., None]  # reads the chunk's start state
    k_tail = k * (gamma[..., -1:] - gamma).exp()[..., None]  # exp(gamma_C - gamma_s) k_s
    increments = k_tail.transpose(-1, -2) @ v  # [N, H, n, dk, dv]: each chunk from zero
    last = gamma[..., -1].exp()  # [N, H, n]

    state = q.new_zeros(n, heads, dk, dv)
    o, state = chunk_loop(inner, q_decay, increments, last, state)  # [N, H, n, C, dv]
    o = o.reshape(n, heads, chunks * c, dv)[:, :, :length]
    return o.transpose(1, 2), state


def chunk_loop(inner, q_decay, increments, last, state):
    """The chunks in order from ``state`` [N, H, dk, dv]: inner [N, H, n, C, dv] (each
    chunk's output from a zero state), q_decay [N, H, n, C, dk], increments
    [N, H, n, dk, dv] (each chunk's state from zero), last [N, H, n] (each chunk's decay
    product) -> (o [N, H, n, C, dv], final state). Planned under ``usp plan``'s fake
    tensors (:class:`_PlannedScanLoop`)."""
    if representative(q_decay):  # usp plan, fake tensors: the loop's memory without its ops
        return _PlannedScanLoop.apply(inner, q_decay, increments, last, state)
    outs = []
    # unbind, not index: the backward of one select per chunk fills a whole zero tensor
    for inner_i, q_i, inc_i, last_i in zip(
        *(t.unbind(2) for t in (inner, q_decay, increments, last))
    ):
        outs.append(inner_i + q_i @ state)
        state = last_i[..., None, None] * state + inc_i
    return torch.stack(outs, dim=2), state


class _PlannedScanLoop(torch.autograd.Function):
    """The loop over chunks of :func:`scalar_decay_padded` as ``usp plan`` measures it
    (fake tensors inside :func:`usp.planning_mode.representative_tiles`): no numbers, a
    handful of allocations that hold at every moment at least what the loop's n chunks
    hold, so a planned step costs the same host time at any length and is never
    optimistic (the twin of :class:`usp.linear.kernel._PlannedChunkLoop`).

    Per (row, head), with V = C * dv (a chunk's output), S = dk * dv (a state), Q = C * dk
    (a chunk's q), n chunks: the real forward keeps, for autograd, the state each chunk
    starts from (n S, the first the zero state the caller made) and views of ``q_decay``
    and ``last`` (the whole tensors); it appends each chunk's output (V) and allocates
    one V- or S-sized temporary at a time inside a chunk; each chunk's end state (S) is
    the next one's start; ``torch.stack`` then copies the n outputs (nV) while they are
    live. So its peak is n(2V + S) + S (the stack, with the final state), and after it
    it keeps n S and the stacked copy. Here: n - 1 states (the first is the input, kept
    by ``save_for_backward``), the n outputs, a max(V, S) temporary, the final state,
    the stacked copy.

    The real backward runs the chunks in reverse; each frees the state it saved (S) and
    makes the gradients of the chunk's slices of ``q_decay`` (Q), ``increments`` (the
    state's gradient, S) and ``last`` (1), with temporaries of at most Q + 4S (the
    state's gradient from the matmul and from the decay's product, their sum, the
    product ``last``'s gradient sums); the gradient of ``inner``'s slice is a view of the
    output's. So after t chunks it holds nS + t(Q + 1) of the two. Autograd holds the
    slices until every chunk's have come; then :func:`torch.unbind`'s backward stacks
    them into each input's whole gradient, one input at a time, freeing that input's
    slices after: in any order at most G + n max(Q, S), with G = n(V + Q + S + 1) the
    whole gradients, the saved states all freed. Here the saved states are held to the
    end (the autograd node keeps them): the slices n(Q + 1) (the states they outgrow),
    the temporary, then the whole gradients with a transient n max(Q - S, 0).
    ``tests/planner/test_planner_granite.py`` measures both under the tracker.
    """

    @staticmethod
    def forward(ctx, inner, q_decay, increments, last, state):
        n, heads, chunks, c, dv = inner.shape
        dk = q_decay.shape[-1]
        # the states the chunks after the first start from
        saved = inner.new_empty(n, heads, (chunks - 1) * dk * dv)
        outs = inner.new_empty(n, heads, chunks, c, dv)
        temporary = inner.new_empty(n, heads, max(c * dv, dk * dv))
        del temporary
        final = state.new_empty(n, heads, dk, dv)
        o = torch.empty_like(outs)  # torch.stack(outs)
        del outs
        # the loop's autograd keeps its slices of these (views: the whole tensors)
        ctx.save_for_backward(saved, q_decay, last, state)
        ctx.inputs = [(t.shape, t.dtype) for t in (inner, q_decay, increments, last, state)]
        return o, final

    @staticmethod
    def backward(ctx, grad_o, grad_final):
        saved, *_ = ctx.saved_tensors  # (all held until this returns)
        n, heads, chunks, c, dv = ctx.inputs[0][0]
        dk = ctx.inputs[1][0][-1]
        # the chunks' gradient slices beyond the saved states they replace
        slices = saved.new_empty(n, heads, chunks * (c * dk + 1))
        temporary = saved.new_empty(n, heads, c * dk + 4 * dk * dv)
        del temporary, slices
        grads = planned_gradients(saved, ctx.inputs, ctx.needs_input_grad)
        # unbind's backward of one input: its whole gradient made while its slices live
        transient = saved.new_empty(n, heads, chunks * max(c * dk - dk * dv, 0))
        del transient, saved
        return tuple(grads)
