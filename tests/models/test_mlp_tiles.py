"""The tiles of every MLP part (the lever ``mlp_tile_tokens``, ``usp.models.levers.tile_mlp``):
the tiled gated MLP (usp.models.mlp_tiles; SwiGLU and GeGLU) in one process: values and
gradients against the untiled MLP through plain autograd, frozen weights, the no-grad
path, autocast, torch.compile, its memory (real, from the profiler's events) and the
planner's representative tiles under fake tensors (identical peaks, fewer tiles run);
the experts' tiles of routed rows (usp.models.moe_op.tiled_experts: SwiGLU and gpt-oss's
clamped SwiGLU) against the untiled experts, their representative tiles; and on 2 gloo
ranks (u1 x r2: 32 local tokens, tiles of 3, the last one partial; the same parts tiled
on 4 ranks against transformers: tests/models/test_families.py's 4-rank cases of Gemma 3,
gpt-oss and Qwen3.5-MoE) the presets whose MLP parts are GeGLU (gemma3-tiny) or experts
(gpt-oss-tiny; qwen3.5-moe-tiny with a shared expert): tiled equals untiled.

Tolerances (relative to the largest magnitude of each tensor, against untiled
autograd in the same dtype): float64 1e-12 (only the order of the weight gradient
sums and of the input gradient's two terms differs), float32 2e-6. bf16 against a
float64 reference: within 1.25x (plus 1e-3) the error of the untiled bf16 MLP (output,
dx) and of the per-tile checkpoint it replaced (weight gradients), and 2e-2.
Multi-rank and FSDP2 coverage of ``mlp_tile_tokens``: test_models_dist.py,
test_train_dist.py; the whole model with every lever: test_levers.py.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from model_cases import TINY
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from usp_cases import topology

import usp
from benchmarks import mlp_fake
from benchmarks.levers_memory import profiled_peak
from usp.models import PRESETS, Levers, LlamaConfig, family_of, moe_op
from usp.models.gpt_oss_experts import GptOssExperts
from usp.models.levers import tile_mlp
from usp.models.mlp import MLP
from usp.models.mlp_tiles import tiled_glu
from usp.models.moe import Experts
from usp.models.moe_op import routed_experts, tiled_experts
from usp.models.tiling import representative_tiles

pytestmark = pytest.mark.usefixtures("one_thread")  # (tests/conftest.py)


def _mlp(dim=32, intermediate=48, dtype=torch.float64, seed=0, activation="silu") -> MLP:
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, "hidden_size": dim, "intermediate_size": intermediate})
    return MLP(config, activation=activation).to(dtype)


def _run(mlp: MLP, x: torch.Tensor, grad: torch.Tensor, tile: int) -> dict:
    """Output, input gradient and the weight gradients of one forward + backward."""
    tile_mlp(mlp, tile)
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.requires_grad)
    out = mlp(x)
    out.backward(grad)
    got = {"out": out.detach(), "dx": x.grad}
    got.update({name: p.grad for name, p in mlp.named_parameters()})
    return got


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


#: (batch, local tokens, tile): a partial last tile, tiles that divide, a batch of 3
SHAPES = [(1, 23, 5), (2, 20, 5), (3, 17, 4), (1, 64, 63)]


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])  # SwiGLU, GeGLU
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("batch, tokens, tile", SHAPES)
def test_tiled_equals_untiled_autograd(dtype, tol, batch, tokens, tile, activation):
    mlp = _mlp(dtype=dtype, activation=activation)
    torch.manual_seed(1)
    x = torch.randn(batch, tokens, 32, dtype=dtype, requires_grad=True)
    grad = torch.randn(batch, tokens, 32, dtype=dtype)
    plain, tiled = _run(mlp, x, grad, 0), _run(mlp, x, grad, tile)
    assert plain.keys() == tiled.keys() and all(v is not None for v in tiled.values())
    for name, want in plain.items():
        assert tiled[name].dtype == want.dtype and tiled[name].shape == want.shape, name
        assert _rel(tiled[name], want) <= tol, (name, _rel(tiled[name], want))


def _per_tile_checkpoint(mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    """What the tiled MLP replaced: each tile under torch.utils.checkpoint, concatenated
    (its weight gradients: each tile's product rounded, then added in AccumulateGrad)."""
    flat = x.reshape(-1, x.shape[-1])
    out = [
        checkpoint(MLP.forward, mlp, t, use_reentrant=False) for t in flat.split(mlp.forward.tile)
    ]
    return torch.cat(out).view(x.shape)


def test_bf16_is_as_close_to_float64_as_before():
    """bf16 against float64 (the same weights and inputs): the output and dx as close
    as the untiled bf16 MLP's; the weight gradients (summed over 15 tiles in bf16) as
    close as the per-tile checkpoint's that this replaced (up to ~2x the untiled
    error: a rounding per tile)."""
    mlp = _mlp(dim=64, intermediate=160, dtype=torch.float64)
    torch.manual_seed(1)
    x = torch.randn(2, 50, 64, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 50, 64, dtype=torch.float64)
    exact = _run(mlp, x, grad, 0)
    mlp = mlp.to(torch.bfloat16)
    x16, grad16 = x.detach().bfloat16().requires_grad_(), grad.bfloat16()
    plain, tiled = _run(mlp, x16, grad16, 0), _run(mlp, x16, grad16, 7)
    mlp.zero_grad(set_to_none=True)
    _per_tile_checkpoint(mlp, x16.detach()).backward(grad16)
    before = {name: p.grad for name, p in mlp.named_parameters()}
    for name, want in exact.items():
        assert tiled[name].dtype == torch.bfloat16, name
        err = _rel(tiled[name], want)
        reference = _rel((before if name in before else plain)[name], want)
        assert err <= 1.25 * reference + 1e-3 and err <= 2e-2, (name, err, reference)


def test_a_strided_input_and_an_expanded_gradient():
    """x not contiguous ([S, B, dim] memory read as [B, S, dim]) and the stride-0
    gradient of ``.sum()``: the untiled numbers."""
    mlp = _mlp()
    torch.manual_seed(1)
    x = torch.randn(19, 2, 32, dtype=torch.float64).transpose(0, 1)  # [2, 19, 32], strided
    runs = {}
    for tile in (0, 4):
        tile_mlp(mlp, tile)
        mlp.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_()
        out = mlp(leaf)
        out.sum().backward()
        runs[tile] = [out.detach(), leaf.grad] + [p.grad for p in mlp.parameters()]
    assert not x.is_contiguous()
    assert all(_rel(a, b) <= 1e-12 for a, b in zip(runs[4], runs[0], strict=True))


def test_at_most_one_tile_of_tokens_is_the_untiled_mlp():
    """tokens <= tile_tokens: the untiled MLP itself, bit for bit (no autograd function)."""
    mlp = _mlp()
    x = torch.randn(2, 8, 32, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 8, 32, dtype=torch.float64)
    plain = _run(mlp, x, grad, 0)
    for tile in (16, 17, 100):
        tile_mlp(mlp, tile)
        assert "Tiled" not in type(mlp(x).grad_fn).__name__
        got = _run(mlp, x, grad, tile)
        assert all(torch.equal(got[n], v) for n, v in plain.items()), tile
    tile_mlp(mlp, 15)
    assert type(mlp(x).grad_fn).__name__ == "_TiledGLUBackward"


@pytest.mark.parametrize(
    "frozen", [("gate_proj",), ("up_proj", "down_proj"), ("gate_proj", "up_proj", "down_proj")]
)
@pytest.mark.parametrize("x_grad", [True, False])
def test_frozen_weights_and_input_get_no_gradient(frozen, x_grad):
    """needs_input_grad is respected: a frozen weight (or an input that needs no
    gradient) gets none, every other gradient is the untiled one."""
    mlp = _mlp()
    torch.manual_seed(1)
    x = torch.randn(1, 21, 32, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(1, 21, 32, dtype=torch.float64)
    plain = _run(mlp, x, grad, 0)
    for name in frozen:
        getattr(mlp, name).weight.requires_grad_(False)
    if len(frozen) == 3 and not x_grad:  # nothing needs a gradient: no graph at all
        tile_mlp(mlp, 4)
        assert mlp(x.detach()).grad_fn is None
        return
    got = _run(mlp, x.detach().requires_grad_(x_grad), grad, 4)
    for name, value in got.items():
        want_none = not x_grad if name == "dx" else name.split(".")[0] in frozen
        if want_none:
            assert value is None, name
        else:
            assert _rel(value, plain[name]) <= 1e-12, name


def test_no_grad_runs_the_tiles_and_keeps_no_graph():
    mlp = _mlp()
    x = torch.randn(2, 19, 32, dtype=torch.float64, requires_grad=True)
    want = MLP.forward(mlp, x).detach()
    tile_mlp(mlp, 4)
    with torch.no_grad():
        out = mlp(x)
    assert out.grad_fn is None and not out.requires_grad
    assert _rel(out, want) <= 1e-12


def test_autocast_matmuls_in_its_dtype_and_gradients_in_the_weights_dtype():
    """Under CPU autocast (bf16), as nn.Linear: the output in bf16, the gradients of the
    float32 weights in float32, all as close to the untiled MLP's as bf16 allows."""
    mlp = _mlp(dim=64, intermediate=96, dtype=torch.float32)
    torch.manual_seed(1)
    x = torch.randn(2, 30, 64, requires_grad=True)
    grad = torch.randn(2, 30, 64, dtype=torch.bfloat16)
    runs = {}
    for tile in (0, 8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            runs[tile] = _run(mlp, x, grad, tile)
    plain, tiled = runs[0], runs[8]
    assert tiled["out"].dtype == torch.bfloat16 and tiled["dx"].dtype == torch.float32
    for name, want in plain.items():
        assert tiled[name].dtype == want.dtype, name
        assert _rel(tiled[name], want) <= 2e-2, (name, _rel(tiled[name], want))


def test_tile_must_be_a_positive_integer():
    w = torch.zeros(4, 2)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="tile must be an integer >= 1, got"):
            tiled_glu(torch.zeros(3, 2), w, w, w.t(), bad)


def test_real_peak_is_one_tiles_work_above_the_results():
    """Forward + backward on real CPU tensors (torch.profiler's memory events): above
    what the step keeps (output, dx, three weight gradients) three [tile, intermediate]
    tensors of work at a time (measured: exactly that), at most one [tile, dim] more.
    (Each tile under torch.utils.checkpoint before: 203.5 -> 142.5 MiB at 8192
    tokens, dim 512, intermediate 1792, tiles of 4096, benchmarks/levers_memory.py.)"""
    tokens, dim, intermediate, tile = 2048, 16, 512, 256
    mlp = _mlp(dim=dim, intermediate=intermediate, dtype=torch.float32)
    tile_mlp(mlp, tile)
    x = torch.randn(1, tokens, dim, requires_grad=True)
    grad = torch.randn(1, tokens, dim)

    def step():
        mlp(x).backward(grad)

    peak = profiled_peak(step)
    kept = (2 * tokens * dim + 3 * dim * intermediate) * 4  # out, dx; three weight grads
    work = 3 * tile * intermediate * 4
    assert kept + work <= peak <= kept + work + tile * dim * 4, (peak, kept, work)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _fake_peak(tokens, tile, *, layer_checkpoint, representative, dtype=torch.bfloat16):
    """Peak bytes (MemTracker) of the tiled MLP's forward + backward under fake tensors
    (``layer_checkpoint``: the whole MLP under a non-reentrant checkpoint, as the layer
    checkpoint runs it), and the number of matrix multiplies it ran."""
    with FakeTensorMode():
        mlp = MLP(LlamaConfig(**{**TINY, "hidden_size": 64, "intermediate_size": 224}))
        for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):  # (no .to() of fakes)
            linear.weight = torch.nn.Parameter(linear.weight.to(dtype))
        tile_mlp(mlp, tile)
        x = torch.randn(1, tokens, 64, dtype=dtype, requires_grad=True)
        grad = torch.randn(1, tokens, 64, dtype=dtype)
        tracker, counter = MemTracker(), _CountMatmuls()
        tracker.track_external(mlp, x, grad)
        with tracker, counter, representative_tiles() if representative else nullcontext():
            out = checkpoint(mlp, x, use_reentrant=False) if layer_checkpoint else mlp(x)
            out.backward(grad)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return peak, counter.count


@pytest.mark.parametrize("layer_checkpoint", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_representative_tiles_give_the_full_loops_peak(layer_checkpoint, dtype):
    """10 tiles, the last partial: the peak of the first and last tile only equals the
    peak of all ten, byte for byte; the representative run did fewer matmuls (forward
    3 per tile, backward 8 per tile; the layer checkpoint adds a forward)."""
    tokens, tile = 9 * 64 + 40, 64
    full, full_mms = _fake_peak(
        tokens, tile, layer_checkpoint=layer_checkpoint, representative=False, dtype=dtype
    )
    some, some_mms = _fake_peak(
        tokens, tile, layer_checkpoint=layer_checkpoint, representative=True, dtype=dtype
    )
    passes = 3 + 8 + (3 if layer_checkpoint else 0)  # matmuls per tile
    assert (full_mms, some_mms) == (10 * passes, 2 * passes)
    assert some == full, (some, full)
    assert full > tokens * 224 * dtype.itemsize  # (one [tokens, intermediate] tensor)


def test_tiled_mlp_compiles_fullgraph():
    """torch.compile(fullgraph, aot_eager) of the tiled MLP: the autograd function is
    traced whole (forward and its backward), equal to eager."""
    mlp = _mlp(dtype=torch.float32)
    tile_mlp(mlp, 5)
    x = torch.randn(2, 13, 32, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    want_out = mlp(x)
    want_out.square().sum().backward()
    want = [x.grad] + [p.grad for p in mlp.parameters()]
    torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_fake_tensor_benchmark_runs_and_its_peaks_agree(capsys):
    """benchmarks/mlp_fake.py at a tiny size: four rows, equal peaks with and without
    the representative tiles."""
    rows = mlp_fake.main(
        [
            "--tokens",
            "600",
            "--dim",
            "64",
            "--intermediate",
            "224",
            "--tile",
            "64",
            "--repeats",
            "1",
        ]
    )
    assert len(rows) == 4 and all(row["seconds"] > 0 for row in rows)
    for ck in (False, True):
        pair = [row["peak"] for row in rows if row["layer_checkpoint"] == ck]
        assert pair[0] == pair[1] > 600 * 224 * 2, pair
    assert "10 tiles of 64" in capsys.readouterr().out


# ---------------------------------------------------------------------- experts
def _experts(kind: str, dtype) -> Experts:
    """6 experts, top 3, hidden 12, intermediate 8 (gpt-oss's clamps binding)."""
    torch.manual_seed(0)
    if kind == "swiglu":
        experts = Experts(6, 12, 8, 3)
    else:
        experts = GptOssExperts(6, 12, 8, 3, alpha=1.702, limit=0.5)
    experts = experts.to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    return experts


def _routing(tokens: int, dtype, seed=1):
    """top-3 of 6 experts that never picks expert 2."""
    scores = torch.rand(tokens, 6, generator=torch.Generator().manual_seed(seed))
    scores[:, 2] = -1
    weights, experts = scores.topk(3, dim=-1)
    return experts, weights.to(dtype)


@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("dtype, tol, grouped", [(torch.float64, 1e-12, False),
                                                 (torch.float32, 2e-6, True)])  # fmt: skip
@pytest.mark.parametrize("frozen", [False, True])
def test_tiled_experts_equal_the_untiled_experts(kind, dtype, tol, grouped, frozen):
    """23 tokens in tiles of 5 (a partial last tile): the output and the gradients of the
    input, the routing weights and every grouped weight (none asked for when frozen:
    LoRA's base) against the experts run at once; expert 2 gets no token."""
    experts = _experts(kind, dtype)
    idx, weights = _routing(23, dtype)
    x = torch.randn(23, 12, dtype=dtype, generator=torch.Generator().manual_seed(2))
    probe = torch.randn(23, 12, dtype=dtype, generator=torch.Generator().manual_seed(3))
    results = []
    for run in (routed_experts, tiled_experts):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, weights)]
        params = [p.detach().clone().requires_grad_(not frozen) for p in experts.op_params()]
        args = (leaves[0], idx, leaves[1], params, experts.kind, experts.op_options(), grouped)
        out = run(*args, 5) if run is tiled_experts else run(*args)
        (out * probe).sum().backward()
        results.append([out.detach()] + [t.grad for t in (*leaves, *params)])
    plain, tiled = results
    assert all(g is None for g in tiled[3:]) if frozen else tiled[3][2].abs().max() == 0
    for want, got in zip(plain, tiled):
        assert (want is None) == (got is None)
        if want is not None:
            assert got.shape == want.shape and _rel(got, want) <= tol


def _experts_fake_peak(tokens=9 * 16 + 5, tile=16):
    """Peak bytes (MemTracker) of the tiled experts' forward + backward as ``usp plan``
    runs them (fake tensors in the planner's mode: the most uneven routing, the
    representative tiles), and the matmuls run."""
    with FakeTensorMode():
        experts = Experts(6, 32, 64, 3)
        x = torch.randn(tokens, 32, requires_grad=True)
        weights = torch.rand(tokens, 3, requires_grad=True)
        idx = torch.randint(0, 6, (tokens, 3))
        grad = torch.randn(tokens, 32)
        tracker, counter = MemTracker(), _CountMatmuls()
        tracker.track_external(experts, x, grad)
        with tracker, counter, representative_tiles():
            args = (x, idx, weights, experts.op_params(), "swiglu", [], False)
            tiled_experts(*args, tile).backward(grad)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return peak, counter.count


def test_representative_tiles_give_the_experts_full_peak(monkeypatch):
    """10 tiles of routed rows, the last partial, planned (the most uneven routing in
    every tile): the first and last tile give the peak of all ten, byte for byte, with
    fewer matmuls (all ten: the loop told the tensors are not representative)."""
    some, some_ops = _experts_fake_peak()
    monkeypatch.setattr(moe_op, "representative", lambda x: False)  # every tile
    full, full_ops = _experts_fake_peak()
    assert some == full and some_ops < full_ops, (some, full, some_ops, full_ops)
    assert full > (9 * 16 + 5) * 3 * 32 * 4  # (the routed rows [N k, H], float32)


# ---------------------------------------------------------------------- 4 ranks
#: the presets whose MLP parts are not SwiGLU alone: GeGLU, clamped-SwiGLU experts,
#: SwiGLU experts with a shared expert
TILED_PRESETS = ["gemma3-tiny", "gpt-oss-tiny", "qwen3.5-moe-tiny"]


def tiles_case(presets, ids, labels):
    """u1 x r2, float32, each preset untiled and with MLP tiles of 3 of its 32 local
    tokens (the same random weights): the loss and the SP-summed gradients."""
    plan = usp.Plan(topology(1, 2), backend="math")
    batch = usp.models.shard_batch(plan, ids, labels=labels, shift=False)
    out = {}
    for name in presets:
        for tile in (0, 3):
            torch.manual_seed(0)
            model = family_of(PRESETS[name]).build(PRESETS[name], plan)
            Levers(mlp_tile_tokens=tile).apply(model)
            loss = model(batch.input_ids, **batch.model_kwargs())
            loss.backward()
            grads = {}
            for n, p in model.named_parameters():
                grads[n] = p.grad.detach().clone()
                dist.all_reduce(grads[n], group=plan.sp_group)
            out[name, tile] = (loss.item(), grads)
    return out if dist.get_rank() == 0 else None


def test_every_mlp_part_tiles_exactly_on_2_ranks(distributed):
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (1, 64), generator=gen)
    labels = torch.randint(0, 256, (1, 64), generator=gen)
    results = distributed.run(tiles_case, TILED_PRESETS, ids, labels, world_size=2, timeout=240)
    results = results[0]
    for name in TILED_PRESETS:
        (plain, plain_grads), (tiled, tiled_grads) = results[name, 0], results[name, 3]
        assert abs(tiled - plain) <= 1e-6 * abs(plain), (name, tiled, plain)
        for n, want in plain_grads.items():
            assert _rel(tiled_grads[n], want) <= 2e-5, (name, n, _rel(tiled_grads[n], want))
