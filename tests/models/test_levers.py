"""The activation-memory levers of usp.models.Llama in one process: the tiled MLP
(``mlp_tile_tokens``) and activation checkpoint offload (``activation_checkpointing =
"offload"``). Multi-rank and trainer (FSDP2) coverage: test_models_dist.py,
test_train_dist.py.

Tolerances: float64 tiled vs untiled 1e-12 relative (only the order of the weight
gradient sums differs); float32 1e-5. Offload vs on-device checkpointing: bit-equal.
"""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch
from model_cases import TINY, relative_error
from usp_cases import load_benchmark

from usp.models import Llama, LlamaConfig, shift_labels
from usp.models.llama import MLP
from usp.models.offload import ACTIVATION_CHECKPOINTING

#: the benchmark's measurement (torch.profiler memory events), tested here too
profiled_peak = load_benchmark("levers_memory").profiled_peak


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _step(config, state, ids, dtype, **options) -> dict:
    model = Llama(config, loss_chunk_tokens=7, **options).to(dtype)
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(ids)
    loss = model(ids, labels=shift_labels(ids))
    loss.backward()
    return {
        "logits": logits,
        "loss": loss.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_every_lever_combination_equals_the_plain_model(dtype, tol):
    """activation_checkpointing x mlp_tile_tokens (tiles that do not divide the 48 local
    tokens, and that do): logits, loss and every gradient."""
    torch.manual_seed(0)
    config = LlamaConfig(**TINY)
    state = {k: v.to(dtype) for k, v in Llama(config).state_dict().items()}
    ids = torch.randint(0, TINY["vocab_size"], (2, 24))  # 48 local tokens
    plain = _step(config, state, ids, dtype)
    for ac, tile in itertools.product(ACTIVATION_CHECKPOINTING, (0, 5, 16)):
        got = _step(config, state, ids, dtype, activation_checkpointing=ac, mlp_tile_tokens=tile)
        errors = [relative_error(got["logits"], plain["logits"])]
        errors.append(relative_error(got["loss"], plain["loss"]))
        errors += [relative_error(g, plain["grads"][n]) for n, g in got["grads"].items()]
        assert max(errors) <= tol, (ac, tile, max(errors))
        if tile == 0:  # untiled: the same arithmetic exactly
            assert torch.equal(got["loss"], plain["loss"]), (ac, tile)
            assert all(torch.equal(g, plain["grads"][n]) for n, g in got["grads"].items())


def test_offload_moves_each_layer_input_off_the_device_tensor():
    """With checkpointing on the device, each layer's input tensor is kept alive by the
    checkpoint until backward; with "offload" only a distinct host copy is kept, so the
    input tensors themselves are freed after forward; backward still runs."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, "num_hidden_layers": 3})
    ids = torch.randint(0, TINY["vocab_size"], (1, 16))
    for mode, expect_alive in ((True, 3), ("offload", 0)):
        model = Llama(config, activation_checkpointing=mode)
        inputs = []
        hooks = [
            layer.register_forward_pre_hook(
                lambda _, args, seen=inputs: seen.append(weakref.ref(args[0]))
            )
            for layer in model.model.layers
        ]
        loss = model(ids, labels=shift_labels(ids))
        for hook in hooks:
            hook.remove()
        gc.collect()
        assert sum(ref() is not None for ref in inputs) == expect_alive, mode
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())


def test_tiled_mlp_holds_one_tile_of_intermediate_activations():
    """Peak bytes of one MLP's forward+backward (torch.profiler memory events): untiled,
    the [tokens, intermediate] activations of the whole input; tiled, of one tile."""
    config = LlamaConfig(**{**TINY, "hidden_size": 16, "intermediate_size": 512})
    mlp = MLP(config)
    x = torch.randn(1, 2048, 16, requires_grad=True)
    peaks = {}
    for tile in (0, 256):
        mlp.tile_tokens = tile

        def step():
            mlp(x).square().sum().backward()

        peaks[tile] = profiled_peak(step)
    mlp.tile_tokens = 4096  # one tile holds every token: the untiled pass itself
    with torch.no_grad():
        assert torch.equal(mlp(x), mlp.swiglu(x))
    one_intermediate = 2048 * 512 * 4  # bytes of one [tokens, intermediate] float32 tensor
    assert peaks[0] >= 3 * one_intermediate, peaks  # gate, up, silu(gate) * up at least
    assert peaks[256] <= peaks[0] / 3, peaks


def test_option_errors_name_the_valid_values():
    config = LlamaConfig(**TINY)
    with pytest.raises(ValueError, match="false, true or 'offload'.*got 'host'"):
        Llama(config, activation_checkpointing="host")
    with pytest.raises(ValueError, match="false, true or 'offload'.*got 1"):
        Llama(config, activation_checkpointing=1)
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="mlp_tile_tokens must be an integer >= 0"):
            Llama(config, mlp_tile_tokens=bad)
    model = Llama(config, activation_checkpointing="offload", mlp_tile_tokens=8)
    assert (model.activation_checkpointing, model.mlp_tile_tokens) == ("offload", 8)
    assert all(layer.mlp.tile_tokens == 8 for layer in model.model.layers)
    assert "activation_checkpointing=offload, mlp_tile_tokens=8" in repr(model)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_attention_head_chunks_give_the_same_numbers(dtype):
    """One process (the local pass once per group of KV heads): 2 groups of the 2 KV
    heads equal one pass bit for bit -- logits, loss, every gradient -- also with
    checkpointing and a tiled MLP."""
    torch.manual_seed(0)
    config = LlamaConfig(**TINY)
    state = {k: v.to(dtype) for k, v in Llama(config).state_dict().items()}
    ids = torch.randint(0, TINY["vocab_size"], (2, 24))
    for options in ({}, {"activation_checkpointing": True, "mlp_tile_tokens": 5}):
        one = _step(config, state, ids, dtype, **options)
        two = _step(config, state, ids, dtype, attention_head_chunks=2, **options)
        assert torch.equal(two["logits"], one["logits"]) and torch.equal(two["loss"], one["loss"])
        assert all(torch.equal(g, one["grads"][n]) for n, g in two["grads"].items())


def test_attention_head_chunks_must_divide_the_kv_heads():
    config = LlamaConfig(**TINY)  # 2 KV heads
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match=r"must divide the 2 KV heads .*one of \[1, 2\]"):
            Llama(config, attention_head_chunks=bad)
    model = Llama(config, attention_head_chunks=2)
    assert model.attention_head_chunks == 2
    assert all(layer.self_attn.head_chunks == 2 for layer in model.model.layers)
    assert "attention_head_chunks=2" in repr(model)
