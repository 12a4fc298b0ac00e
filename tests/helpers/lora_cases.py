"""The LoRA tests' reference: transformers' model with PEFT's LoRA on it, initialised and
dropped out as usp's LoRA documents (usp/models/lora.py, usp/models/lora_dropout.py),
written here independently of usp's code.

* :func:`peft_model`: HF's model of a checkpoint (float64, tests/helpers/model_cases.py)
  wrapped by ``peft.get_peft_model(LoraConfig(...))``, every ``lora_A`` drawn by the
  documented recipe -- one ``torch.Generator`` seeded with the seed, ``kaiming_uniform_(a
  = sqrt(5))`` in float32, module after module in the model's order -- and ``lora_B`` zero.
* :class:`KeyedDropout` replaces PEFT's ``nn.Dropout`` of each adapter with the documented
  keyed mask, computed with numpy's uint64 arithmetic (wrapping multiplication, logical
  shifts): ``u = token * features + feature``, ``splitmix64(u ^ salt)``, kept where the
  top 24 bits are >= round(p * 2**24); the salt of the i-th adapted module is
  ``splitmix64(splitmix64(seed * G) + (i + 1) * G)`` with G = 0x9E3779B97F4A7C15. Which
  tokens a forward sees is set on :class:`Tokens` (their data-stream indices).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import usp.models
from usp.models.lora import set_stream_position

GOLDEN = 0x9E3779B97F4A7C15
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
M64 = (1 << 64) - 1


def splitmix_int(x: int) -> int:
    x &= M64
    x = ((x ^ (x >> 30)) * MIX1) & M64
    x = ((x ^ (x >> 27)) * MIX2) & M64
    return x ^ (x >> 31)


def salt(seed: int, index: int) -> int:
    return splitmix_int((splitmix_int(seed * GOLDEN) + (index + 1) * GOLDEN) & M64)


def keep(tokens, features: int, p: float, module_salt: int) -> np.ndarray:
    """bool [len(tokens), features], with numpy's uint64 arithmetic."""
    with np.errstate(over="ignore"):
        u = np.asarray(tokens, dtype=np.uint64)[:, None] * np.uint64(features)
        x = (u + np.arange(features, dtype=np.uint64)[None]) ^ np.uint64(module_salt)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(MIX1)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(MIX2)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(40)) >= np.uint64(round(p * (1 << 24)))


class Tokens:
    """The data-stream indices of the tokens the next forward sees ([rows] in order)."""

    def __init__(self):
        self.indices = None


class KeyedDropout(nn.Module):
    def __init__(self, p: float, module_salt: int, tokens: Tokens):
        super().__init__()
        self.p, self.salt, self.tokens = p, module_salt, tokens

    def forward(self, x):
        if not self.training:
            return x
        rows = x.reshape(-1, x.shape[-1])
        mask = torch.from_numpy(keep(self.tokens.indices, x.shape[-1], self.p, self.salt))
        assert mask.shape == rows.shape, (mask.shape, rows.shape)
        return (rows * mask.to(x.dtype) / (1 - self.p)).view(x.shape)


def lora_layers(model) -> list[tuple[str, nn.Module]]:
    """PEFT's LoRA layers of ``model``, in module order."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "lora_A", None), nn.ModuleDict) and "default" in m.lora_A
    ]


def peft_model(
    directory, *, rank, alpha, targets, seed, dropout=0.0, dtype=torch.float64, tokens=None,
    load=None,
):  # fmt: skip
    """``(model, tokens)``: HF + PEFT as the module docstring says; ``tokens`` (a
    :class:`Tokens`) feeds the keyed dropout when ``dropout > 0``; ``load(directory,
    dtype)``: the family's reference loader (default: model_cases.load_hf_reference)."""
    from model_cases import load_hf_reference
    from peft import LoraConfig, get_peft_model

    base = (load or load_hf_reference)(directory, dtype=dtype)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    tokens = tokens or Tokens()
    with torch.no_grad():
        for index, (_, layer) in enumerate(lora_layers(model)):
            a = torch.empty(layer.lora_A["default"].weight.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            layer.lora_A["default"].weight.copy_(a)
            layer.lora_B["default"].weight.zero_()
            if dropout > 0:
                layer.lora_dropout["default"] = KeyedDropout(dropout, salt(seed, index), tokens)
    return model, tokens


def usp_name(peft_name: str) -> str:
    """A PEFT parameter's name as usp's model names it."""
    name = peft_name.removeprefix("base_model.model.")
    for which in ("lora_A", "lora_B"):
        name = name.replace(f".{which}.default.weight", f".{which}")
    return name.replace(".base_layer.", ".")


def adapter_grads(model) -> dict[str, torch.Tensor]:
    """The adapters' gradients of a PEFT model, by usp's names."""
    return {usp_name(n): p.grad for n, p in model.named_parameters() if p.requires_grad}


def sp_adapter_step(model, plan, ids, labels, cu, b_values, stream_position: int = 640):
    """One SP step of an adapted usp model on this rank (the 4-rank LoRA cases): the
    adapters' B matrices set to ``b_values``, the batch sharded with documents ``cu``,
    dropout keyed from ``stream_position``; returns, on rank 0, the loss on every rank
    and the adapters' gradients summed over the SP group (asserting only adapters get
    gradients), None elsewhere."""
    with torch.no_grad():
        for name, value in b_values.items():
            model.get_parameter(name).copy_(value)
    batch = usp.models.shard_batch(plan, ids, labels=labels, cu_seqlens=cu, shift=False)
    set_stream_position(model, stream_position)
    loss = model(batch.input_ids, **batch.model_kwargs())
    loss.backward()
    losses = [None] * plan.sp_degree
    dist.all_gather_object(losses, loss.item(), group=plan.sp_group)
    grads = {}
    for n, p in model.named_parameters():
        assert (p.grad is not None) == ("lora" in n), n
        if p.grad is not None:
            grads[n] = p.grad.detach().clone()
            dist.all_reduce(grads[n], group=plan.sp_group)
    return None if dist.get_rank() else {"losses": losses, "grads": grads}
