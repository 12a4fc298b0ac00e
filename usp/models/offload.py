"""Activation-memory levers of the decoder stack: how each layer's checkpoint is kept.

``activation_checkpointing`` takes one of :data:`ACTIVATION_CHECKPOINTING`:

* ``False``: every activation of every layer stays on the device until backward;
* ``True``: only each layer's input stays (on the device); backward re-runs the layer;
* ``"offload"``: as ``True``, but each layer's input lives in host memory between its
  forward and its recompute. On CUDA the copy goes to pinned memory on a side stream
  (it overlaps the next layers' compute) and the recompute waits for it before the copy
  back; elsewhere it is a plain host copy (a distinct tensor, so the path is exercised).

The offload is a :func:`torch.autograd.graph.saved_tensors_hooks` context around the
checkpointed call: non-reentrant checkpointing saves the layer's inputs through
autograd's saved-tensor mechanism, outside its own hooks, so the outer hooks see them.
Only the one tensor named (the hidden states) moves; the layer's other inputs (the RoPE
tables, shared by every layer) stay where they are. Values are copied bit for bit, so
the losses and gradients equal on-device checkpointing exactly.

**Pieces.** torch's pinned (CUDA host) allocator gives every block the next power of two
of bytes (``CachingHostAllocator``), so one pinned block per layer input would cost up
to twice its bytes: a 3.53 GiB input takes 4 GiB, one just past 4 GiB takes 8. Each host
copy is therefore kept as the pieces :func:`pinned_pieces` names -- the powers of two of
its element count's binary form down to :data:`MIN_PIECE_ELEMENTS`, then the rest as one
piece -- which the allocator takes as they are, but for the last piece's rounding (under
2 MiB in bf16). The pieces are the same on every device (the CPU path runs them too), and
``usp plan`` counts the same rounding (:func:`pinned_waste`).

Where the host copies go is :attr:`HostOffloader.host_device` (``cpu``; real runs keep
it). A memory estimate that runs a CUDA step on CPU fake tensors (a torch without CUDA,
:mod:`usp.planner.measure`) sets it to ``meta``, so its memory tracker counts the copies
apart from the CPU stand-in of the device, as host memory.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

#: the values of ``activation_checkpointing`` (model option and ``[train]`` key)
ACTIVATION_CHECKPOINTING = (False, True, "offload")

#: the smallest power-of-two piece of a host copy; what is left below it is one piece
#: (so a copy has at most ~log2(numel / this) + 1 pieces, 12 for 2^31 elements)
MIN_PIECE_ELEMENTS = 2**20


def pinned_pieces(numel: int, min_piece: int | None = None) -> list[int]:
    """The element counts of a host copy's pieces, largest first: each power of two of
    ``numel``'s binary form that is at least ``min_piece``, then the remainder (below
    ``min_piece``) as one piece. They add up to ``numel``; in a dtype whose size is a
    power of two every piece but the last is a power of two of bytes. ``min_piece``:
    :data:`MIN_PIECE_ELEMENTS` by default."""
    min_piece = MIN_PIECE_ELEMENTS if min_piece is None else min_piece
    pieces = []
    rest = numel
    bit = 1 << (numel.bit_length() - 1) if numel > 0 else 0
    while bit >= min_piece and rest:
        if rest & bit:
            pieces.append(bit)
            rest -= bit
        bit >>= 1
    if rest:
        pieces.append(rest)
    return pieces


def pinned_bytes(nbytes: int) -> int:
    """What torch's pinned (CUDA host) allocator takes for a block of ``nbytes``: the
    next power of two (``CachingHostAllocator``: ``PowerOf2Ceil``). The one statement of
    that rule: ``usp plan``'s pinned rounding (:mod:`usp.planner.overheads`) uses it too."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def pinned_waste(numel: int, itemsize: int, min_piece: int | None = None) -> int:
    """Bytes the pinned allocator adds to a host copy of ``numel`` elements of
    ``itemsize`` bytes held as :func:`pinned_pieces` (each piece rounded up by
    :func:`pinned_bytes`; 0 when every piece is a power of two already)."""
    return sum(pinned_bytes(n * itemsize) - n * itemsize for n in pinned_pieces(numel, min_piece))


class _HostCopy:
    """One offloaded tensor: its host copy in pieces (:func:`pinned_pieces`), and how to
    bring it back as one tensor."""

    __slots__ = ("device", "dtype", "pieces", "ready", "shape")

    def __init__(self, tensor: torch.Tensor, stream, host_device: torch.device, min_piece: int):
        self.device, self.dtype, self.shape = tensor.device, tensor.dtype, tensor.shape
        self.ready = None
        flat = tensor.detach().reshape(-1)  # a view of the (contiguous) hidden states
        bounds = _bounds(pinned_pieces(flat.numel(), min_piece))
        if stream is None:  # CPU (or no CUDA runtime): plain, distinct host copies
            self.pieces = [flat[a:b].to(host_device, copy=True) for a, b in bounds]
            return
        # pinned host memory; the copies run on the side stream once the producer is done
        self.pieces = [
            torch.empty(b - a, dtype=tensor.dtype, device="cpu", pin_memory=True) for a, b in bounds
        ]
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            for piece, (a, b) in zip(self.pieces, bounds):
                piece.copy_(flat[a:b], non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)
        # neither memory is reused before the copies are done (``flat`` is ``tensor``'s
        # storage, or its contiguous copy when the hidden states were strided)
        tensor.record_stream(stream)
        flat.record_stream(stream)

    def restore(self) -> torch.Tensor:
        """The tensor on its device again (after the copies to the host have finished)."""
        if self.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready)
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        flat = out.view(-1)
        for piece, (a, b) in zip(self.pieces, _bounds([p.numel() for p in self.pieces])):
            flat[a:b].copy_(piece, non_blocking=self.ready is not None)
        return out


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` of consecutive pieces of these sizes."""
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return out


class HostOffloader:
    """Keeps checkpointed layer inputs in host memory; one per model (it owns the side
    stream of each CUDA device it has copied from).

    ``host_device``: where the host copies of non-CUDA tensors go (``cpu``). Only a
    memory estimate changes it (to ``meta``, under fake tensors: see the module
    docstring); CUDA tensors of a CUDA runtime always go to pinned CPU memory.
    ``min_piece``: :func:`pinned_pieces`' smallest power-of-two piece (elements)."""

    def __init__(self, min_piece: int | None = None):
        self._streams: dict[torch.device, object] = {}
        self.host_device = torch.device("cpu")
        self.min_piece = min_piece

    def _stream(self, device: torch.device):
        if device.type != "cuda" or not torch.cuda.is_available():
            return None  # e.g. fake CUDA tensors of a memory estimate: a plain host copy
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    @contextlib.contextmanager
    def hold(self, tensor: torch.Tensor):
        """Inside this context, when autograd saves ``tensor`` (this very object) it saves
        a host copy instead, and restores it to the device when backward needs it.
        Other saved tensors are kept as they are."""

        target = weakref.ref(tensor)  # autograd may keep the hooks: they must not keep it

        def pack(saved):
            if saved is not target():
                return saved
            return _HostCopy(saved, self._stream(saved.device), self.host_device, self.min_piece)

        def unpack(packed):
            return packed.restore() if isinstance(packed, _HostCopy) else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
