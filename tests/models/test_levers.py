"""The memory levers (``usp.models.Levers``, applied to a model from outside) in one
process: the tiled MLP (``mlp_tile_tokens``), activation checkpointing and its offload
(``activation_checkpointing = "offload"``), head chunks and the loss chunk; on every
model family and on an HF transformers model. Multi-rank and trainer (FSDP2) coverage:
test_models_dist.py, test_train_dist.py.

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

from usp.models import FAMILIES, LeverError, Levers, Llama, LlamaConfig, levers_of, shift_labels
from usp.models.levers import tile_mlp
from usp.models.mlp import MLP
from usp.models.offload import ACTIVATION_CHECKPOINTING

#: the benchmark's measurement (torch.profiler memory events), tested here too
profiled_peak = load_benchmark("levers_memory").profiled_peak


pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _step(config, state, ids, dtype, *, model_class=Llama, **options) -> dict:
    model = model_class(config).to(dtype)
    model.load_state_dict(state)
    Levers(loss_chunk_tokens=7, **options).apply(model)
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
        model = Levers(activation_checkpointing=mode).apply(Llama(config))
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


@pytest.mark.parametrize(
    "numel", [0, 1, 2**20 - 1, 2**20, 2**20 + 1, 3 * 2**29 + 12345, 1_895_825_408, 2**31 + 5]
)
def test_host_copies_are_held_in_power_of_two_pieces(numel):
    """``pinned_pieces``: the binary form's powers of two down to the minimum piece, then
    the rest; they add up to the copy. Rounded by the pinned allocator (next power of two
    of bytes, ``usp.models.offload.pinned_bytes``) they waste at most the last piece's
    rounding, where one block of a 3.53 GiB layer input (1,895,825,408 bf16 elements:
    Llama-3.1-8B at 462,848 local tokens) would waste 0.47 GiB."""
    from usp.models.offload import MIN_PIECE_ELEMENTS, pinned_bytes, pinned_pieces, pinned_waste

    pieces = pinned_pieces(numel)
    assert sum(pieces) == numel and all(p > 0 for p in pieces)
    assert pieces == sorted(pieces, reverse=True) and len(set(pieces)) == len(pieces)
    powers = [p for p in pieces if p >= MIN_PIECE_ELEMENTS]
    assert all(p & (p - 1) == 0 for p in powers) and len(pieces) - len(powers) <= 1
    waste = pinned_waste(numel, 2)
    assert waste == sum(pinned_bytes(2 * p) - 2 * p for p in pieces)
    assert waste < 2 * MIN_PIECE_ELEMENTS  # under one minimum piece's bytes (bf16)
    if numel == 1_895_825_408:
        assert pinned_bytes(2 * numel) - 2 * numel > 0.46 * 2**30 > 1000 * waste


def test_offload_in_pieces_equals_on_device_checkpointing(monkeypatch):
    """Each layer input's host copy in several pieces (a minimum piece of 8 elements):
    logits, loss and every gradient bit-equal to checkpointing on the device."""
    from usp.models import offload

    torch.manual_seed(0)
    config = LlamaConfig(**TINY)
    state = Llama(config).state_dict()
    ids = torch.randint(0, TINY["vocab_size"], (2, 24))
    seen = []

    def spy(numel, min_piece=None):
        seen.append(pieces := real(numel, min_piece))
        return pieces

    real = offload.pinned_pieces
    monkeypatch.setattr(offload, "pinned_pieces", spy)
    runs = {}
    for mode in (True, "offload"):
        model = Llama(config)
        model.load_state_dict(state)
        offloader = offload.HostOffloader(min_piece=8)
        Levers(activation_checkpointing=mode).apply(model, offloader=offloader)
        loss = model(ids, labels=shift_labels(ids))
        loss.backward()
        runs[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    # 48 tokens x hidden 32 = 1536 = 1024 + 512 elements: two pieces per layer input
    assert seen == [[1024, 512]] * TINY["num_hidden_layers"]
    assert torch.equal(runs["offload"][0], runs[True][0])
    assert all(torch.equal(g, runs[True][1][n]) for n, g in runs["offload"][1].items())


def test_tiled_mlp_holds_one_tile_of_intermediate_activations():
    """Peak bytes of one MLP's forward+backward (torch.profiler memory events): untiled,
    the [tokens, intermediate] activations of the whole input; tiled, of one tile."""
    config = LlamaConfig(**{**TINY, "hidden_size": 16, "intermediate_size": 512})
    mlp = MLP(config)
    x = torch.randn(1, 2048, 16, requires_grad=True)
    peaks = {}
    for tile in (0, 256):
        tile_mlp(mlp, tile)

        def step():
            mlp(x).square().sum().backward()

        peaks[tile] = profiled_peak(step)
    with torch.no_grad():
        tile_mlp(mlp, 0)
        plain = mlp(x)
        tile_mlp(mlp, 4096)  # one tile holds every token: the untiled pass itself
        assert torch.equal(mlp(x), plain)
    one_intermediate = 2048 * 512 * 4  # bytes of one [tokens, intermediate] float32 tensor
    assert peaks[0] >= 3 * one_intermediate, peaks  # gate, up, silu(gate) * up at least
    assert peaks[256] <= peaks[0] / 3, peaks


def test_option_errors_name_the_valid_values():
    with pytest.raises(LeverError, match="true, false or \"offload\".*got 'host'"):
        Levers(activation_checkpointing="host")
    with pytest.raises(LeverError, match='true, false or "offload".*got 1'):
        Levers(activation_checkpointing=1)
    with pytest.raises(LeverError, match="offload_parameters must be false unless offload_opt"):
        Levers(offload_parameters=True)
    for bad in (-1, 2.0, True):
        with pytest.raises(LeverError, match="mlp_tile_tokens must be an integer >= 0"):
            Levers(mlp_tile_tokens=bad)
    for bad in (0, 2.0, True):
        with pytest.raises(LeverError, match="attention_head_chunks must be an integer >= 1"):
            Levers(attention_head_chunks=bad)
    with pytest.raises(LeverError, match="loss_chunk_tokens must be a positive integer"):
        Levers(loss_chunk_tokens=0)
    model = Levers("offload", 8).apply(Llama(LlamaConfig(**TINY)))
    assert levers_of(model) == Levers(activation_checkpointing="offload", mlp_tile_tokens=8)
    assert levers_of(model).describe() == "checkpointing offload, MLP tiles 8, loss chunks 1024"
    assert all(layer.mlp.forward.tile == 8 for layer in model.model.layers)


def test_levers_leave_parameter_names_and_apply_again():
    """Applied from outside: the state dict keys stay HF's; a second apply replaces the
    first (here: back to none), and the model is then the plain model again."""
    config = LlamaConfig(**TINY)
    model = Llama(config)
    keys = list(model.state_dict())
    Levers(True, 5, 2, None).apply(model)
    assert list(model.state_dict()) == keys
    assert model.loss_chunk_tokens is None
    Levers().apply(model)
    for layer in model.model.layers:
        assert "forward" not in vars(layer) and "forward" not in vars(layer.mlp)
        assert layer.self_attn.head_chunks == 1
    assert model.loss_chunk_tokens == Levers().loss_chunk_tokens


def test_levers_refuse_a_compiled_layer_and_a_non_swiglu_mlp():
    model = Llama(LlamaConfig(**TINY))
    layer = model.model.layers[0]
    layer.forward = torch.compile(layer.forward)
    with pytest.raises(LeverError, match="apply levers before compiling"):
        Levers(activation_checkpointing=True).apply(model)
    mlp = MLP(LlamaConfig(**TINY))
    mlp.act_fn = torch.nn.GELU()
    with pytest.raises(LeverError, match="needs a SwiGLU MLP"):
        tile_mlp(mlp, 4)


def test_tiled_mlp_takes_only_silu_among_transformers_activations():
    """Every activation transformers names (``ACT2FN``) in an HF gated MLP: tiling is
    exact (SiLU: output and gradients equal the untiled MLP's, float64) or refused with
    a LeverError; GELU variants (Gemma's ``gelu_pytorch_tanh``) must not pass as SiLU."""
    transformers = pytest.importorskip("transformers")
    from transformers.activations import ACT2FN
    from transformers.models.llama.modeling_llama import LlamaMLP

    x = torch.randn(2, 12, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    tiled = set()
    for name in sorted(ACT2FN):
        config = transformers.LlamaConfig(
            hidden_size=16, intermediate_size=40, num_attention_heads=4, hidden_act=name
        )
        torch.manual_seed(0)
        mlp = LlamaMLP(config).double()
        try:
            tile_mlp(mlp, 5)
        except LeverError as err:
            assert "needs a SwiGLU MLP" in str(err) and "mlp_tile_tokens = 0" in str(err)
            continue
        tiled.add(name)
        inputs = x.clone().requires_grad_()
        out = mlp(inputs)
        out.square().sum().backward()
        grads = [inputs.grad, *(p.grad for p in mlp.parameters())]
        tile_mlp(mlp, 0)
        mlp.zero_grad()
        inputs = x.clone().requires_grad_()
        expected = mlp(inputs)
        expected.square().sum().backward()
        expected_grads = [inputs.grad, *(p.grad for p in mlp.parameters())]
        assert relative_error(out, expected) <= 1e-12, name
        assert max(map(relative_error, grads, expected_grads)) <= 1e-12, name
    assert {"silu", "swish"} <= tiled, tiled  # transformers' SiLU and torch's
    assert not tiled & {"gelu", "gelu_pytorch_tanh", "gelu_new", "quick_gelu", "relu"}, tiled


#: families whose levers are tested in their own files, on their own checkpoints
#: (tests/models/test_gemma3.py and test_qwen3_5.py: test_levers_give_the_same_numbers;
#: test_granite_hybrid.py: test_lora_default_targets_and_levers)
OWN_LEVER_TESTS = {"gemma3", "qwen3_5", "qwen3_5_moe", "granitemoehybrid"}


@pytest.mark.parametrize("family", [f.name for f in FAMILIES if f.name not in OWN_LEVER_TESTS])
def test_every_family_takes_every_lever(family):
    """Each family's model with all levers on equals its plain model (float64)."""
    from model_cases import family_config

    f = next(f for f in FAMILIES if f.name == family)
    torch.manual_seed(0)
    config = family_config(family)
    state = {k: v.double() for k, v in f.build(config).state_dict().items()}
    ids = torch.randint(0, config.vocab_size, (1, 24))
    plain = _step(config, state, ids, torch.float64, model_class=f.model_class)
    levered = _step(
        config, state, ids, torch.float64, model_class=f.model_class,
        activation_checkpointing="offload", mlp_tile_tokens=5, attention_head_chunks=2,
    )  # fmt: skip
    errors = [relative_error(levered["loss"], plain["loss"])]
    errors += [relative_error(g, plain["grads"][n]) for n, g in levered["grads"].items()]
    assert max(errors) <= 1e-12, (family, max(errors))


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
    model = Llama(LlamaConfig(**TINY))  # 2 KV heads
    for bad in (3, 4):
        with pytest.raises(LeverError, match=r"must divide the 2 KV heads .*one of \[1, 2\]"):
            Levers(attention_head_chunks=bad).apply(model)
    Levers(attention_head_chunks=2).apply(model)
    assert levers_of(model).attention_head_chunks == 2
    assert all(layer.self_attn.head_chunks == 2 for layer in model.model.layers)


def test_levers_under_compile_equal_eager():
    """``[train] compile`` compiles each layer's own forward inside the levers' wrappers
    (usp.train.parallelize.compile_layers, fullgraph): with checkpointing, its offload
    (saved-tensor hooks, which fullgraph cannot trace) and MLP tiles the loss and every
    gradient equal the eager model's; levers applied after compiling are refused."""
    from usp.train.parallelize import compile_layers

    torch.manual_seed(0)
    config = LlamaConfig(**TINY)
    state = Llama(config).state_dict()
    ids = torch.randint(0, TINY["vocab_size"], (1, 24))
    plain = _step(config, state, ids, torch.float32)
    for ac, tile in (("offload", 0), (True, 5)):
        model = Levers(activation_checkpointing=ac, mlp_tile_tokens=tile).apply(Llama(config))
        model.load_state_dict(state)
        compile_layers(model, backend="aot_eager")
        loss = model(ids, labels=shift_labels(ids))
        loss.backward()
        errors = [relative_error(loss.detach(), plain["loss"])]
        errors += [relative_error(p.grad, plain["grads"][n]) for n, p in model.named_parameters()]
        assert max(errors) <= 1e-5, (ac, tile, max(errors))
        with pytest.raises(LeverError, match="apply levers before compiling"):
            Levers().apply(model)
    torch._dynamo.reset()


@pytest.mark.parametrize("family", [f.name for f in FAMILIES])
def test_mlp_tiles_reach_every_mlp_part_of_every_family(family):
    """What ``MLP tiles N`` in usp train's start-up line says is what each layer runs:
    every gated MLP's forward tiled, every mixture of experts' routed rows (and its shared
    expert); ``Levers()`` takes them off again."""
    f = next(f for f in FAMILIES if f.name == family)
    config = next(iter(f.presets.values())).replace(num_hidden_layers=2)
    with torch.device("meta"):
        model = f.build(config)
    for tile in (7, 0):
        Levers(mlp_tile_tokens=tile).apply(model)
        for layer in model.decoder_layers:
            mlp = layer.mlp
            experts = getattr(mlp, "experts", None)
            glus = [mlp] if experts is None else [m for m in [mlp.shared_expert] if m is not None]
            if experts is not None:
                assert experts.tile_tokens == tile, (family, tile)
            for glu in glus:
                tiled = vars(glu).get("forward")
                assert (tiled.tile if tiled is not None else 0) == tile, (family, tile)
