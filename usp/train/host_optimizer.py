"""AdamW with its state in host memory and its update on the host (``[train]
offload_optimizer = true``, :class:`usp.models.Levers` ``offload_optimizer``).

:class:`HostAdamW` is a ``torch.optim.AdamW`` over the model's own parameters (so DCP's
``get_state_dict(model, optimizer)``, the schedule's ``param_groups`` and the FSDP memory
tracker see an ordinary AdamW), whose ``step`` does, parameter by parameter:

1. copy the local shard of the parameter and of its gradient to the host
   (``host_device``; pageable memory: the pinned allocator would keep a block per
   distinct shard size, each rounded up to a power of two, and the update, not the
   copy, is what the step waits for);
2. run torch's own single-tensor AdamW arithmetic (``torch.optim.adamw.adamw``,
   ``foreach=False``) there, on the float32 copies and the state (``exp_avg``,
   ``exp_avg_sq``: DTensors over the parameter's mesh whose local tensors live on the
   host, the way FSDP2's ``CPUOffloadPolicy`` keeps offloaded shards; ``step``: a CPU
   scalar, as AdamW keeps it);
3. copy the updated shard back into the parameter.

The device then holds parameters and gradients, never the two AdamW moments (8 bytes per
parameter shard). With ``offload_parameters`` the parameters and gradients already live
on the host (FSDP2's ``CPUOffloadPolicy``): ``params_on_host=True`` updates them in place,
no copy. The numbers are AdamW's own: on the CPU (where torch's AdamW also takes the
single-tensor path) they equal an on-device AdamW bit for bit, which
``tests/train/test_train_offload.py`` checks on 4 gloo ranks; there host and device are
one memory, so the copies are distinct tensors (the path runs) that share a memory.

``load_state_dict`` keeps the state on the host: torch's own casts every state tensor to
its parameter's device, which would put the whole state on the GPU for the load.
``host_device`` is ``cpu`` for real runs; only a memory estimate changes it (the planner's
``meta`` stand-in for host memory, :mod:`usp.planner.measure`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` as ``param`` is seen from outside: a DTensor over the parameter's mesh
    and placements when the parameter is one (its local tensor may live elsewhere, as
    FSDP2's offloaded shards do), else ``local`` itself."""
    if not hasattr(param, "to_local"):
        return local
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False,
        shape=param.shape, stride=param.stride(),
    )  # fmt: skip


class HostAdamW(torch.optim.AdamW):
    """AdamW whose moments live on ``host_device`` and whose update runs there (see the
    module docstring). ``params_on_host``: the parameters and gradients are host tensors
    already (FSDP2 parameter offload): updated in place. Other arguments as AdamW's;
    ``amsgrad``, ``maximize`` and ``capturable`` are AdamW's defaults (off)."""

    def __init__(self, params, *, params_on_host: bool = False, **adamw_kwargs) -> None:
        for key in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
            if adamw_kwargs.get(key):
                raise ValueError(f"HostAdamW does not take {key}=True")
        super().__init__(params, foreach=False, **adamw_kwargs)
        self.params_on_host = params_on_host
        self.host_device = torch.device("cpu")

    def _new_state(self, param: torch.Tensor) -> dict:
        local = _local(param)
        zeros = {
            key: torch.zeros(local.shape, dtype=torch.float32, device=self._home(local))
            for key in _STATE_KEYS
        }
        state = {key: _like_param(value, param) for key, value in zeros.items()}
        state["step"] = torch.tensor(0.0, dtype=torch.float32)  # (AdamW's: a CPU scalar)
        return state

    def _home(self, local: torch.Tensor) -> torch.device:
        """Where a parameter's update runs: its own device when it lives on the host."""
        return local.device if self.params_on_host else self.host_device

    def _to_host(self, local: torch.Tensor) -> torch.Tensor:
        """A float32 host copy of a device tensor (a distinct tensor, so the copy-back is
        a real write, also where host and device are one memory)."""
        host = torch.empty(local.shape, dtype=torch.float32, device=self.host_device)
        host.copy_(local)  # (blocking: the update reads it next)
        return host

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(self._new_state(param))
                device_param, device_grad = _local(param), _local(param.grad)
                if self.params_on_host:
                    host_param, host_grad = device_param, device_grad
                else:  # [shard] device -> host
                    host_param, host_grad = self._to_host(device_param), self._to_host(device_grad)
                adamw(
                    [host_param], [host_grad],
                    [_local(state["exp_avg"])], [_local(state["exp_avg_sq"])], [],
                    [state["step"]], foreach=False, amsgrad=False, beta1=beta1, beta2=beta2,
                    lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                    maximize=False,
                )  # fmt: skip
                if host_param is not device_param:  # [shard] host -> device
                    device_param.copy_(host_param)
                del host_param, host_grad
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """As AdamW's, with every state tensor put on the host (see the module docstring):
        the saved parameters are matched to this optimizer's in order, group by group."""
        saved_groups = state_dict["param_groups"]
        ids = [i for group in saved_groups for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        if len(saved_groups) != len(self.param_groups) or len(ids) != len(params):
            raise ValueError(
                f"the optimizer state has {len(saved_groups)} group(s) of {len(ids)} "
                f"parameters; this optimizer has {len(self.param_groups)} of {len(params)}"
            )
        by_id = dict(zip(ids, params))
        state: defaultdict = defaultdict(dict)
        for key, values in state_dict["state"].items():
            param = by_id[key]
            home = self._home(_local(param))
            state[param] = {
                name: value.detach().clone().to("cpu", torch.float32)
                if name == "step"
                else _like_param(_local(value).detach().to(home, torch.float32).clone(), param)
                for name, value in values.items()
            }
        self.state = state
        for group, saved in zip(self.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
