"""The gated delta rule in torch: a chunked form (the CPU kernel) and a step-by-step
recurrence (its reference).

Per head, with a state ``S`` of [d_k, d_v], for every token t (the convention of
transformers' ``torch_chunk_gated_delta_rule`` and of fla)::

    S <- exp(g_t) * S               (Gated DeltaNet: g_t one number per head;
                                     KDA: diag(exp(g_t)) S, g_t one per key channel)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t                   (q_t already scaled, by 1/sqrt(d_k) by default)

The chunked form (derived from the recurrence, chunk length C, gamma = cumsum(g) inside
the chunk, Gamma = exp(gamma)): with A[t, s] = beta_t exp(gamma_t - gamma_s) k_t.k_s for
s < t and T = (I + A)^-1,

    U = T diag(beta) V - T diag(beta Gamma) K S0     (the "delta" rows of the chunk)
    O = diag(Gamma) Q S0 + (Q K^T * exp(gamma_t - gamma_s) [s <= t]) U
    S_C = Gamma_C S0 + K^T diag(exp(gamma_C - gamma)) U

Everything except the last three lines is computed for every chunk at once; the loop over
chunks is three matmuls per chunk. Autograd gives the backward. With a decay per key
channel (Kimi Delta Attention) Gamma is diagonal per token and the same lines hold with
``k_t.k_s`` and ``q_t.k_s`` weighted per channel by ``exp(gamma_t - gamma_s)``: a
[C, C, d_k] factor per chunk (C times q's size), every exponent <= 0.

Sequences with documents are computed as a padded batch of segments ([N, L, H, D], one
row per document, zeros after its end): a zero key with beta = 0 and g = 0 leaves the
state as it was, so a segment's final state is exact whatever its padding.

Precision: float64 inputs compute in float64, everything else in float32 (the state and
the final state are in that dtype); outputs come back in the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from usp.planning_mode import planned_gradients, representative

__all__ = [
    "chunk_gated_delta_rule",
    "compute_dtype",
    "gated_delta_rule_padded",
    "l2norm",
    "recurrent_gated_delta_rule",
    "segment_rows",
    "to_padded",
    "from_padded",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the normalisation transformers and
    fla apply to q and k)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[.., Hk, D] -> [.., heads, D]: value head e uses key head e // (heads / Hk)."""
    hk = x.shape[-2]
    if hk == heads:
        return x
    if heads % hk:
        raise ValueError(f"{heads} value heads are not a multiple of {hk} key heads")
    return x.repeat_interleave(heads // hk, dim=-2)


# ---------------------------------------------------------------------------- segments
def segment_rows(bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For segments [bounds[i], bounds[i+1]) of a sequence: the padded layout's source
    rows (int64 [N * L], -1 past a segment's end), the valid mask ([N, L] bool) and L."""
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    longest = max(lengths, default=0)
    offsets = torch.arange(longest)
    starts = torch.tensor(bounds[:-1], dtype=torch.int64)
    lens = torch.tensor(lengths, dtype=torch.int64)
    valid = offsets[None, :] < lens[:, None]  # [N, L]
    rows = torch.where(valid, starts[:, None] + offsets[None, :], -1)
    return rows.reshape(-1), valid, longest


def to_padded(x: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, S, ...] -> [B * N, L, ...] (segment-major within each batch row; zeros past a
    segment's end). Differentiable."""
    n, length = valid.shape
    picked = x.index_select(1, rows.clamp(min=0).to(x.device))  # [B, N*L, ...]
    mask = valid.reshape(1, -1, *([1] * (x.dim() - 2))).to(x.device)
    picked = picked * mask
    return picked.reshape(x.shape[0] * n, length, *x.shape[2:])


def from_padded(y: torch.Tensor, valid: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of :func:`to_padded` for segments that tile the sequence in order:
    [B * N, L, ...] -> [B, S, ...]. Differentiable."""
    flat = y.reshape(batch, -1, *y.shape[2:])  # [B, N*L, ...]
    keep = valid.reshape(-1).nonzero().squeeze(1).to(y.device)
    return flat.index_select(1, keep)


# ---------------------------------------------------------------------------- kernels
def gated_delta_rule_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule on independent rows, in the compute dtype already
    (no casts, no normalisation, q already scaled).

    q, k [N, L, H, dk]; v [N, L, H, dv]; g [N, L, H] (a log decay per head) or
    [N, L, H, dk] (per key channel: KDA); beta [N, L, H]; initial_state [N, H, dk, dv]
    or None (zeros). Returns (o [N, L, H, dv], final state [N, H, dk, dv]).
    ``chunk_size`` is bounded by L: a longer chunk only pads the rows (a [C, C] system
    per row and head: C = 4096 over 32 tokens took minutes and GBs), for the same result.
    """
    n, length, heads, dk = k.shape
    dv = v.shape[-1]
    c = max(1, min(chunk_size, length))
    pad = (-length) % c
    per_channel = g.dim() == k.dim()  # KDA: a decay per key channel
    if pad:  # zero keys, beta = 0, g = 0 after the end: the state is left as it was
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, 0) * per_channel + (0, 0, 0, pad))
        beta = F.pad(beta, (0, 0, 0, pad))
    chunks = (length + pad) // c

    # [N, H, n_chunks, C, D]
    def chunked(t):
        return t.transpose(1, 2).reshape(n, heads, chunks, c, *t.shape[3:])

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    strict = lower.logical_and(~torch.eye(c, dtype=torch.bool, device=q.device))
    if per_channel:
        gamma = g.cumsum(-2)  # [N, H, n, C, dk]
        diff = gamma[..., :, None, :] - gamma[..., None, :, :]  # [.., C, C, dk]
        decay = diff.masked_fill(~lower[..., None], float("-inf")).exp()
        kk = torch.einsum("...tk,...tsk,...sk->...ts", k, decay, k)  # decay inside
        qk = torch.einsum("...tk,...tsk,...sk->...ts", q, decay, k)  # [.., C, C]
        a = (beta[..., :, None] * kk).masked_fill(~strict, 0)
    else:
        gamma = g.cumsum(-1)[..., None]  # [N, H, n, C, 1]
        diff = gamma[..., :, None, 0] - gamma[..., None, :, 0]  # gamma_t - gamma_s
        decay = diff.masked_fill(~lower, float("-inf")).exp()  # [.., C, C], 0 above the diagonal
        kk = k @ k.transpose(-1, -2)
        a = (beta[..., :, None] * decay * kk).masked_fill(~strict, 0)
        qk = (q @ k.transpose(-1, -2)) * decay  # [.., C, C]
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    t_inv = torch.linalg.solve_triangular(
        a + eye, eye.expand_as(a), upper=False, unitriangular=True
    )
    u0 = t_inv @ (beta[..., None] * v)  # [.., C, dv]
    w = t_inv @ (beta[..., None] * gamma.exp() * k)  # [.., C, dk]
    q_decay = q * gamma.exp()
    k_tail = k * (gamma[..., -1:, :] - gamma).exp()  # exp(gamma_C - gamma_s) k_s
    last = gamma[..., -1, :].exp()  # [N, H, n, dk] (or [.., 1]: one decay per head)

    state = q.new_zeros(n, heads, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    if representative(q):  # usp plan, fake tensors: the loop's memory without its ops
        o, state = _PlannedChunkLoop.apply(u0, w, q_decay, qk, k_tail, last, state)
        return o.reshape(n, heads, chunks * c, dv)[:, :, :length].transpose(1, 2), state
    outs = []
    # unbind, not index: the backward of one select per chunk fills a whole zero tensor
    per_chunk = zip(*(t.unbind(2) for t in (u0, w, q_decay, qk, k_tail, last)))
    for u0_i, w_i, q_i, qk_i, k_i, last_i in per_chunk:
        u = u0_i - w_i @ state
        outs.append(q_i @ state + qk_i @ u)
        state = last_i[..., :, None] * state + k_i.transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(n, heads, chunks * c, dv)[:, :, :length]
    return o.transpose(1, 2), state


class _PlannedChunkLoop(torch.autograd.Function):
    """The loop over chunks of :func:`gated_delta_rule_padded` as ``usp plan`` measures
    it (fake tensors inside :func:`usp.models.tiling.representative_tiles`): no numbers,
    a handful of allocations that hold at every moment at least what the loop's n chunks
    hold, so a planned step costs the same host time at any length (the loop is 7 ops a
    chunk, 2048 chunks a layer at 1M tokens on 8 ranks) and is never optimistic.

    Per (row, head), with V = C * dv, S = dk * dv, n chunks: the real forward keeps, for
    autograd, each chunk's ``u`` (V) and the state it starts from (S, the first being
    the input), appends each chunk's output (V) and allocates at most two V- or S-sized
    temporaries inside a chunk; ``torch.stack`` then copies the n outputs (nV) while
    they are live. So its peak is at most n(2V + S) + 2 max(V, S) or n(3V + S), and it
    keeps n V + (n - 1) S for the backward, and its slices (views) of the inputs it
    multiplies by; here: the same kept, n outputs, a 2 max(V, S) temporary, the stacked
    copy and the final state.

    The real backward runs the chunks in reverse; each frees that chunk's saved tensors
    and adds its gradients of the chunk's slices of the six inputs (held by autograd
    until every chunk's have come: :func:`torch.unbind`'s backward stacks them, one
    input at a time) with temporaries of at most 4V + 6S (the gradient of ``u`` from two
    uses, its negation and sum; the state's from three uses, their sums and the incoming
    one). So it holds at most n(V + S) + 2G + 4V + 6S with G the inputs' gradients; here:
    the saved tensors kept to the end, the chunks' slices (G), the temporary, then every
    whole gradient (G) before the slices are released.
    ``tests/planner/test_planner_gdn.py`` measures both under the tracker.
    """

    @staticmethod
    def forward(ctx, u0, w, q_decay, qk, k_tail, last, state):
        n, heads, chunks, c, dv = u0.shape
        dk = w.shape[-1]
        # each chunk's u, and the states the chunks after the first start from
        # (and one more V a chunk: under activation checkpointing the loop's backward
        # peak was measured up to 0.98 V a chunk above what the terms here account for)
        saved = u0.new_empty(n, heads, 2 * chunks * c * dv + (chunks - 1) * dk * dv)
        outs = u0.new_empty(n, heads, chunks, c, dv)
        temporary = u0.new_empty(n, heads, 2 * max(c * dv, dk * dv))
        del temporary
        o = torch.empty_like(outs)  # torch.stack(outs)
        del outs
        final = state.new_empty(n, heads, dk, dv)
        # the loop's autograd keeps its slices of these (views: the whole tensors)
        ctx.save_for_backward(saved, w, q_decay, qk, k_tail, last, state)
        ctx.inputs = [(t.shape, t.dtype) for t in (u0, w, q_decay, qk, k_tail, last, state)]
        return o, final

    @staticmethod
    def backward(ctx, grad_o, grad_final):
        saved = ctx.saved_tensors[0]
        # the chunks' gradient slices, held until the last chunk (one tensor per input)
        slices = planned_gradients(saved, ctx.inputs, ctx.needs_input_grad)
        n, heads, _, c, dv = ctx.inputs[0][0]
        dk = ctx.inputs[1][0][-1]
        temporary = saved.new_empty(n, heads, 4 * c * dv + 6 * dk * dv)
        del temporary
        # unbind's backward stacks each input's slices; the backward of the ops that made
        # the inputs may run before the last stack (autograd's order): counted as if
        # every slice were held until every whole gradient is made
        grads = planned_gradients(saved, ctx.inputs, ctx.needs_input_grad)
        del slices, saved
        return tuple(grads)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """Cast to the compute dtype, expand key heads to value heads, normalise and scale."""
    dtype = compute_dtype(v.dtype)
    heads = v.shape[-2]
    q, k = (_expand_heads(t.to(dtype), heads) for t in (q, k))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v.to(dtype), g.to(dtype), beta.to(dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over a batch of sequences, or of packed documents.

    q, k [B, S, Hk, dk]; v [B, S, H, dv] (H a multiple of Hk: value head e uses key head
    e // (H / Hk)); g (log decay, <= 0) and beta [B, S, H]. ``scale`` multiplies q (default
    1/sqrt(dk)), after the l2 normalisation of q and k when ``use_qk_l2norm``.
    ``cu_seqlens``: boundaries [0, ..., S] of documents (the state restarts at each; every
    batch row has the same ones). ``initial_state``: [B * N, H, dk, dv] (N documents per
    row, 1 without cu_seqlens) or None for zeros. Returns (o [B, S, H, dv] in v's dtype,
    the final states [B * N, H, dk, dv] in the compute dtype, or None).
    """
    batch, seq_len = v.shape[:2]
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    bounds = [0, seq_len] if cu_seqlens is None else [int(b) for b in cu_seqlens]
    if bounds[0] != 0 or bounds[-1] != seq_len or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to {seq_len}, got {bounds}")
    q, k, v2, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    rows, valid, _ = segment_rows(bounds)
    padded = [to_padded(t, rows, valid) for t in (q, k, v2, g, beta)]
    o, state = gated_delta_rule_padded(*padded, initial_state=initial_state, chunk_size=chunk_size)
    o = from_padded(o, valid, batch)
    return o.to(v.dtype), state if output_final_state else None


def recurrent_gated_delta_rule(
    q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (the reference of the chunked form; one sequence per
    batch row). Shapes as :func:`chunk_gated_delta_rule`; returns (o, final state)."""
    q, k, v2, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    batch, seq_len, heads, dk = k.shape
    state = q.new_zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state
    outs = []
    for t in range(seq_len):
        state = state * g[:, t].exp()[..., None, None]
        kv = (state * k[:, t, :, :, None]).sum(-2)  # S^T k: [B, H, dv]
        delta = (v2[:, t] - kv) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, dim=1).to(v.dtype), state
