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


def check_activation_checkpointing(value) -> bool | str:
    """``value`` if it is one of :data:`ACTIVATION_CHECKPOINTING`, else a ValueError."""
    if value is True or value is False or (isinstance(value, str) and value == "offload"):
        return value
    raise ValueError(
        f"activation_checkpointing must be false, true or 'offload' (each layer's "
        f"checkpoint kept in host memory), got {value!r}"
    )


class _HostCopy:
    """One offloaded tensor: its host copy, and how to bring it back."""

    __slots__ = ("device", "host", "ready")

    def __init__(self, tensor: torch.Tensor, stream, host_device: torch.device):
        self.device = tensor.device
        self.ready = None
        if stream is None:  # CPU (or no CUDA runtime): a plain, distinct host copy
            self.host = tensor.detach().to(host_device, copy=True)
            return
        # pinned host memory; the copy runs on the side stream once the producer is done
        self.host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            self.host.copy_(tensor, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)
        tensor.record_stream(stream)  # its memory is not reused before the copy is done

    def restore(self) -> torch.Tensor:
        """The tensor on its device again (after the copy to the host has finished)."""
        if self.ready is None:
            return self.host if self.host.device == self.device else self.host.to(self.device)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        return self.host.to(self.device, non_blocking=True)


class HostOffloader:
    """Keeps checkpointed layer inputs in host memory; one per model (it owns the side
    stream of each CUDA device it has copied from).

    ``host_device``: where the host copies of non-CUDA tensors go (``cpu``). Only a
    memory estimate changes it (to ``meta``, under fake tensors: see the module
    docstring); CUDA tensors of a CUDA runtime always go to pinned CPU memory."""

    def __init__(self):
        self._streams: dict[torch.device, object] = {}
        self.host_device = torch.device("cpu")

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
            return _HostCopy(saved, self._stream(saved.device), self.host_device)

        def unpack(packed):
            return packed.restore() if isinstance(packed, _HostCopy) else packed

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
