"""The Trainer integration's parts in one process: the sampler by data-parallel
replica, a collator's batch as usp's global batch, the batch fingerprint, USP attention
under autocast against sdpa under autocast, the HF-model levers (MLP tiles, head chunks,
the chunked loss inside the model's forward), the refusals of model features and
Trainer settings, the launch's plan, the command-line flags, ``usp plan`` reading
the config a run writes, and two shuffled epochs of a Trainer in two orders.
"""

from __future__ import annotations

import inspect
import itertools
import types

import pytest
import torch
import torch.nn.functional as F
from fla_standin import standin_conv_kernel, standin_kernel
from model_cases import TINY, hf_config, relative_error
from qwen3_5_cases import as_float64_reference, hf_text_config, randomise

transformers = pytest.importorskip(
    "transformers", minversion="5.24", reason="the integration needs transformers 5.24"
)
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate")

import usp  # noqa: E402
import usp.models.hf as usp_hf  # noqa: E402
from usp.integrations import hf_cli  # noqa: E402
from usp.integrations.hf_setup import compute_device, kernel_problem, window_problem  # noqa: E402
from usp.integrations.transformers import (  # noqa: E402
    DataParallelSampler,
    UnsupportedModelError,
    UspTrainer,
    attention_chunk,
    check_training_arguments,
    feature_problems,
    global_batch,
    launch_plan,
    plan_config,
    prepare_model,
)
from usp.linear import GatedDeltaNet, backends, conv  # noqa: E402
from usp.models import Levers, shard_batch, shift_labels  # noqa: E402
from usp.models.batch import batch_fingerprint  # noqa: E402
from usp.models.hf_inputs import HFInputError  # noqa: E402
from usp.process_groups import SINGLE_PROCESS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
PLAN = usp.Plan(None)


# ----------------------------------------------------------------------------- sampler
def replica_batches(length, batch, dp, *, shuffle, epoch=0, drop_last=False):
    """Per optimizer micro-step, the union of the replicas' samples, in replica order."""
    per_replica = []
    for rank in range(dp):
        sampler = DataParallelSampler(
            length, batch_size=batch, dp_rank=rank, dp_degree=dp, shuffle=shuffle, seed=3,
            drop_last=drop_last,
        )  # fmt: skip
        sampler.set_epoch(epoch)
        indices = list(sampler)
        assert len(indices) == len(sampler)
        per_replica.append([indices[i : i + batch] for i in range(0, len(indices), batch)])
    return [sum(step, []) for step in zip(*per_replica)]


@pytest.mark.parametrize("shuffle", [False, True])
def test_the_replicas_share_out_the_one_process_batches(shuffle):
    """10 samples, 2 per replica: 1, 2 and 4 replicas see the global batches one process
    with the whole global batch sees; the last one is completed from the epoch's start."""
    for dp in (2, 4):
        alone = replica_batches(10, 2 * dp, 1, shuffle=shuffle)
        assert replica_batches(10, 2, dp, shuffle=shuffle) == alone
        flat = sum(alone, [])
        assert sorted(set(flat)) == list(range(10))  # every sample, the rest repeated
        assert flat[10:] == flat[: len(flat) - 10]
    if shuffle:
        assert replica_batches(10, 2, 2, shuffle=True) != replica_batches(
            10, 2, 2, shuffle=True, epoch=1
        )
    else:
        assert sum(replica_batches(10, 2, 2, shuffle=False), []) == [*range(10), 0, 1]
    assert sum(replica_batches(10, 2, 2, shuffle=False, drop_last=True), []) == list(range(8))
    with pytest.raises(ValueError, match="leaves nothing"):
        DataParallelSampler(3, batch_size=2, dp_degree=2, drop_last=True)


# ----------------------------------------------------------------------------- batches
def hf_count(batch) -> int:
    """What transformers' Trainer counts as the step's targets (labels[..., 1:])."""
    return int((batch["labels"][..., 1:] != -100).sum())


def test_padding_free_batches_keep_their_documents():
    pytest.importorskip("trl", reason="TRL's padding-free collator")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    features = [{"input_ids": list(range(5, 5 + n))} for n in (3, 5, 2)]
    for collator in (
        DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True),  # cu_seq_lens
        transformers.DataCollatorWithFlattening(),  # position_ids only
    ):
        batch = collator(features)
        got = global_batch(batch, PLAN)
        assert got.cu_seqlens.tolist() == [0, 3, 8, 10]
        assert torch.equal(got.input_ids, batch["input_ids"])
        assert got.label_count() == hf_count(batch) == 2 + 4 + 1


def test_right_padded_rows_become_documents_and_left_padding_is_refused():
    tokenizer = _tokenizer()
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    batch = collator([{"input_ids": [7, 8, 9, 10]}, {"input_ids": [11, 12]}])
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    got = global_batch(batch, PLAN)
    assert got.input_ids.tolist() == [[7, 8, 9, 10, 11, 12]]
    assert got.cu_seqlens.tolist() == [0, 4, 6]
    assert got.label_count() == hf_count(batch) == 3 + 1
    assert shift_labels(got.labels, cu_seqlens=got.cu_seqlens).tolist() == [
        [8, 9, 10, -100, 12, -100]
    ]
    left = dict(batch, attention_mask=torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]))
    with pytest.raises(HFInputError, match="row 1 .*left padding"):
        global_batch(left, PLAN)
    dense = {"input_ids": torch.arange(8).view(2, 4)}
    assert global_batch(dense, PLAN).cu_seqlens is None
    # rows a grid cannot place as they are (u2 x r2 zigzag needs multiples of 4): packed
    grid_of_4 = types.SimpleNamespace(sequence_multiple=4)
    assert global_batch(dense, grid_of_4).cu_seqlens is None
    odd = global_batch({"input_ids": torch.arange(10).view(2, 5)}, grid_of_4)
    assert odd.cu_seqlens.tolist() == [0, 5, 10] and odd.input_ids.shape == (1, 10)


def _tokenizer():
    import trainer_cases

    return trainer_cases.tokenizer_object()


def test_the_fingerprint_tells_batches_apart():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :3] = -100
    base = batch_fingerprint(ids, labels)
    assert batch_fingerprint(ids.clone(), labels.clone()) == base
    changed = ids.clone()
    changed[1, 7] = (changed[1, 7] + 1) % 64
    swapped = ids.clone()
    swapped[0, [2, 9]] = swapped[0, [9, 2]]
    other_labels = labels.clone()
    other_labels[0, 5] = -100
    variants = [
        batch_fingerprint(changed, labels),
        batch_fingerprint(swapped, labels) if not torch.equal(swapped, ids) else None,
        batch_fingerprint(ids, other_labels),
        batch_fingerprint(ids.reshape(1, 32), labels.reshape(1, 32)),
        batch_fingerprint(ids, None),
    ]
    assert all(v != base for v in variants if v is not None)
    assert len(set(variants)) == len(variants)
    # one process: nothing to agree on, no fingerprint computed
    assert shard_batch(PLAN, ids).fingerprint is None


# ----------------------------------------------------------------------------- the plug-in
def test_usp_attention_under_autocast_is_sdpa_under_autocast():
    """The mixed dtypes autocast hands an attention function (q/k float32 after RoPE,
    v bf16): computed in bf16 with a float32 merge, as sdpa computes them; then a
    whole model's logits and gradients under autocast, within bf16 rounding."""
    fn = transformers.AttentionInterface()[usp_hf.register(PLAN, name="usp-autocast")]
    sdpa = transformers.AttentionInterface()["sdpa"]
    module = torch.nn.Module()
    module.is_causal = True
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 8, 12, 8, generator=gen)
    k = torch.randn(1, 2, 12, 8, generator=gen)
    v = torch.randn(1, 2, 12, 8, generator=gen).bfloat16()
    module.num_key_value_groups = 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = fn(module, q, k, v, None, scaling=8**-0.5)
        expected, _ = sdpa(module, q, k, v, None, scaling=8**-0.5, is_causal=True)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert relative_error(out, expected) < 1e-2
    with pytest.raises(usp.InputError):  # without autocast: refused, as sdpa refuses it
        fn(module, q, k, v, None)

    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(hf_config()).train()
    model = transformers.LlamaForCausalLM(hf_config()).train()
    model.load_state_dict(reference.state_dict())
    model.set_attn_implementation("usp-autocast")
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), generator=gen)
    results = []
    for m in (reference, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(ids, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1)[:-1], ids.flatten()[1:])
        loss.backward()
        results.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert relative_error(results[1][0], results[0][0]) < 2e-2
    grads = [relative_error(results[1][1][n], g) for n, g in results[0][1].items()]
    assert max(grads) < 5e-2, grads


def test_hf_models_take_every_lever():
    """Levers on an HF model, one process, float64: MLP tiles (transformers' SiLU),
    checkpointing, 2 head chunks read by the plug-in from the attention module, the
    chunked loss inside the model's forward: the plain model's loss and gradients."""
    torch.manual_seed(0)
    name = usp_hf.register(PLAN, name="usp-levers")
    plain = transformers.LlamaForCausalLM(hf_config()).double()
    ids = torch.randint(0, TINY["vocab_size"], (1, 20))
    batch = shard_batch(PLAN, ids)
    out = {}
    for levers in (Levers(loss_chunk_tokens=None), Levers(True, 5, 2, 3)):
        model = transformers.LlamaForCausalLM(hf_config()).double()
        model.load_state_dict(plain.state_dict())
        model.set_attn_implementation(name)
        levers.apply(model, PLAN)
        if levers.loss_chunk_tokens is None:
            loss = usp_hf.sp_loss(model(**batch.hf_kwargs()).logits, batch.labels, PLAN)
        else:
            loss = usp_hf.causal_lm_loss(model, batch, PLAN, chunk_tokens=levers.loss_chunk_tokens)
        loss.backward()
        out[levers] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
        assert all(layer.self_attn.head_chunks == levers.attention_head_chunks
                   for layer in model.model.layers)  # fmt: skip
    (plain_loss, plain_grads), (loss, grads) = out.values()
    assert abs(loss - plain_loss) <= 1e-12 * plain_loss
    assert max(relative_error(grads[n], g) for n, g in plain_grads.items()) < 1e-10


def test_the_loss_forward_keeps_the_model_forward():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config())
    signature = inspect.signature(model.forward)
    ids = torch.randint(0, TINY["vocab_size"], (1, 12))
    before = model(ids).logits
    usp_hf.add_loss_forward(model)
    usp_hf.add_loss_forward(model)  # idempotent
    assert inspect.signature(model.forward) == signature  # what Trainer's columns read
    assert torch.equal(model(ids).logits, before)
    batch = shard_batch(PLAN, ids)
    chunked = usp_hf.causal_lm_loss(model, batch, PLAN, chunk_tokens=5)
    assert abs(chunked.item() - usp_hf.sp_loss(before, batch.labels, PLAN).item()) < 1e-6


# ----------------------------------------------------------------------------- refusals
def _gemma2():
    config = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config)


def test_model_features_usp_cannot_compute_are_named():
    gemma = _gemma2()
    chunked = feature_problems(gemma, Levers())
    assert any("attn_logit_softcapping=50.0" in p for p in chunked)
    assert any("final_logit_softcapping" in p for p in chunked)
    unchunked = feature_problems(gemma, Levers(loss_chunk_tokens=None))
    assert len(unchunked) == 1  # the logits' softcapping is computed by the model itself
    llama = transformers.LlamaForCausalLM(hf_config(attention_dropout=0.1))
    assert feature_problems(llama, Levers()) == [
        "attention dropout (config.attention_dropout=0.1): set it to 0.0 (USP attention has "
        "no dropout)"
    ]
    llama = transformers.LlamaForCausalLM(hf_config())
    assert feature_problems(llama, Levers()) == []
    # attention sinks (gpt-oss's s_aux) are computed by USP attention: no problem
    llama.model.layers[1].self_attn.sinks = torch.nn.Parameter(torch.zeros(8))
    assert feature_problems(llama, Levers()) == []
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        UspTrainer(model=gemma, args=_args(), train_dataset=[{"input_ids": [1, 2]}], plan=PLAN)


def test_gated_deltanet_layers_become_usps_and_restart_at_documents():
    """prepare_model puts usp's Gated DeltaNet in place of transformers' (Qwen3.5: layers
    0 and 2), the parameter names kept; in one process too (4 ranks: test_trainer_dist's
    qwen3_5 case). A padding-free row of two documents gives each document's logits of
    transformers' own model run on it alone (its torch path would run them as one
    sequence), float64 (transformers' float32 parts in float64, as tests/models do)."""
    torch.manual_seed(1)
    reference = transformers.Qwen3_5ForCausalLM(hf_text_config("tied")).double()
    randomise(reference)
    model = transformers.Qwen3_5ForCausalLM(hf_text_config("tied")).double()
    model.load_state_dict(reference.state_dict())
    # transformers' norms and GDN in float64 (it computes them in float32: qwen3_5_cases);
    # the model's patched GDN forwards go with the swap
    for hf_model in (reference, model):
        as_float64_reference(hf_model)
    prepared = prepare_model(model, PLAN, Levers(loss_chunk_tokens=None), name="usp-gdn")
    assert prepared.linear_attention_layers == 2
    swapped = [i for i, layer in enumerate(model.model.layers)
               if isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet)]  # fmt: skip
    assert swapped == [0, 2]
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    ids = torch.randint(0, 64, (1, 21), generator=torch.Generator().manual_seed(2))
    cu = torch.tensor([0, 9, 21], dtype=torch.int32)
    batch = shard_batch(PLAN, ids, cu_seqlens=cu)
    with torch.no_grad():
        got = model(**batch.hf_kwargs()).logits
        alone = [reference(input_ids=ids[:, a:b], use_cache=False).logits
                 for a, b in ((0, 9), (9, 21))]  # fmt: skip
        expected = torch.cat(alone, dim=1)
        as_one = reference(input_ids=ids, use_cache=False).logits
    assert relative_error(got, expected) < 1e-10
    assert relative_error(as_one[:, 9:], expected[:, 9:]) > 1e-3  # the documents matter


def test_the_gdn_kernels_are_the_plans_choice(monkeypatch):
    """The plan's ``linear_backend`` / ``linear_conv_backend`` (options of ``launch_plan``,
    ``register`` and ``swap_linear_attention``, as ``backend`` is) choose the kernels of
    the swapped Gated DeltaNet layers: a forced fla on this CPU is refused when the model
    is prepared, before anything runs; forced fla and causal-conv1d stand-ins (CPU,
    tests/helpers/fla_standin.py) compute every GDN layer, with transformers' logits."""
    torch.manual_seed(1)
    reference = transformers.Qwen3_5ForCausalLM(hf_text_config("tied"))
    randomise(reference)

    def fresh():
        model = transformers.Qwen3_5ForCausalLM(hf_text_config("tied"))
        model.load_state_dict(reference.state_dict())
        return model

    # fla as if not installed (the dev extra installs fla-core: its kernels run on CPU only
    # under Triton's interpreter, tests/kernels/test_fla_interpreted.py)
    absent = backends.FlaGdnKernel(module="usp_test_no_such_package.ops")
    monkeypatch.setattr(backends, "DEFAULT", backends.GdnKernels(backends.TorchGdnKernel(), absent))
    refused = (
        r'its Gated DeltaNet layers: linear_backend = "fla" cannot run the Gated DeltaNet '
        r"recurrence here \(cpu, torch.float32, dk=8\): it needs fla .* set linear_backend = "
        r'"auto" \(fla where it can run, else usp\'s torch kernel\) or "torch"'
    )
    with pytest.raises(UnsupportedModelError, match=refused):
        prepare_model(fresh(), launch_plan(linear_backend="fla"), Levers(), name="usp-fla")
    # the device the model will compute on decides, not the one it was loaded on: under a
    # plan of CUDA processes FSDP2 moves the weights there (fla is still not installed)
    on_gpus = types.SimpleNamespace(
        topology=types.SimpleNamespace(world_size=4), default_device=lambda: torch.device("cuda", 0)
    )
    assert compute_device(fresh(), on_gpus) == torch.device("cuda", 0)
    assert compute_device(fresh(), PLAN, use_cpu=True) == torch.device("cpu")
    loaded = fresh()
    usp_hf.swap_linear_attention(loaded, None, linear_backend="fla")
    problem = kernel_problem(loaded, launch_plan(linear_backend="fla"), torch.device("cuda", 0))
    assert "(cuda, torch.float32, dk=8): it needs fla (pip install 'usp[fla]'), which" in problem

    fla, conv1d = standin_kernel(float64=False), standin_conv_kernel()
    monkeypatch.setattr(backends, "DEFAULT", backends.GdnKernels(backends.TorchGdnKernel(), fla))
    monkeypatch.setitem(conv.DEFAULT, "causal_conv1d", conv1d)
    plan = launch_plan(linear_backend="fla", linear_conv_backend="causal_conv1d")
    model = fresh()
    prepare_model(model, plan, Levers(loss_chunk_tokens=None), name="usp-fla")
    ids = torch.randint(0, 64, (1, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(**shard_batch(plan, ids).hf_kwargs()).logits
        expected = reference(input_ids=ids, use_cache=False).logits
    assert relative_error(got, expected) < 1e-5
    # the self-checks' calls (fla: one; causal-conv1d: one per activation), then one per
    # GDN layer (layers 0 and 2)
    assert len(fla._function.calls) == 1 + 2 and len(conv1d._function.calls) == 2 + 2

    model = fresh()
    assert usp_hf.swap_linear_attention(model, None, linear_backend="torch") == 2
    assert model.model.layers[0].linear_attn.plan.linear_backend == "torch"
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert len(fla._function.calls) == 3, "torch forced: fla not called"


def test_attention_chunks_are_refused_and_sliding_windows_are_not():
    """Llama 4's chunked layers are read as transformers reads them and refused for a
    sequence longer than the chunk; causal sliding windows (Mistral, Gemma 2) are
    computed by USP attention, whatever their length."""
    llama4 = transformers.Llama4TextConfig(attention_chunk_size=16)
    assert attention_chunk(llama4) == 16
    assert window_problem(llama4, 16) is None
    problem = window_problem(llama4, 17)
    assert "17 tokens" in problem and "chunks of 16 tokens" in problem
    only_full = transformers.Llama4TextConfig(attention_chunk_size=16, num_hidden_layers=2)
    only_full.layer_types = ["full_attention", "full_attention"]
    assert attention_chunk(only_full) is None
    for config in (transformers.MistralConfig(sliding_window=16), _gemma2().config):
        assert attention_chunk(config) is None and window_problem(config, 10**6) is None


def _args(output_dir="never-written", **changes):
    """TrainingArguments on the CPU (a Trainer built with them writes to output_dir)."""
    return transformers.TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, report_to=[], **changes
    )


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
        ({"train_sampling_strategy": "group_by_length"}, "group_by_length"),
        ({"activation_checkpointing": True}, "in both the TrainingArguments"),
        ({"torch_compile": True}, "torch_compile"),
    ],
)
def test_trainer_settings_usp_replaces_are_refused(changes, needle):
    levers = Levers(activation_checkpointing=True)
    with pytest.raises(usp.ConfigError, match=needle):
        check_training_arguments(_args(**changes), levers=levers)
    with pytest.raises(usp.ConfigError, match="compute_loss_func"):
        check_training_arguments(_args(), compute_loss_func=lambda *a, **k: 0)
    check_training_arguments(_args(), levers=levers)  # the defaults are fine


# ----------------------------------------------------------------------------- set-up
def test_one_process_plans_and_the_flags():
    assert launch_plan().topology is SINGLE_PROCESS
    with pytest.raises(usp.TopologyError, match="torchrun --nproc-per-node 4") as info:
        launch_plan(2, 2)
    import argparse

    parser = argparse.ArgumentParser()
    hf_cli.add_arguments(parser)
    # the examples' flags that run one process (those after torchrun's command line)
    assert "the examples' --ulysses 1 --ring 1" in str(info.value), str(info.value)
    assert parser.parse_args(["--ulysses", "1", "--ring", "1"]).ring == 1
    for flags, expected in [
        ([], Levers()),
        (["--activation-checkpointing", "offload", "--mlp-tile-tokens", "64",
          "--attention-head-chunks", "2", "--loss-chunk-tokens", "0"],
         Levers("offload", 64, 2, None)),
    ]:  # fmt: skip
        assert hf_cli.levers_from_args(parser.parse_args(flags)) == expected


def test_usp_plan_plans_the_run_a_trainer_describes(tmp_path):
    """The config a run writes names the same model (its config.json through the family
    registry), lengths and levers, and the planner measures exactly that run: its grid
    with its levers, one rank's step under fake tensors (``usp plan FILE`` runs the same
    measurement for every grid and lever; tests/planner cover the search)."""
    import trainer_cases

    from usp.planner import search
    from usp.planner.footprint import Choice, Target
    from usp.train.components import model_source
    from usp.train.config import load_train_config

    ckpt = trainer_cases.write_checkpoint(tmp_path / "qwen3", "qwen3")
    levers = Levers(activation_checkpointing="offload", mlp_tile_tokens=8192)  # searched
    path = tmp_path / "plan.toml"
    path.write_text(
        plan_config(
            ckpt, seq_len=64, sequences_per_forward=2, sequences_per_step=4, nodes=1,
            gpus_per_node=2, ulysses=1, ring=2, levers=levers,
        )
    )  # fmt: skip
    job = load_train_config(path)
    assert (job.train.seq_len, job.train.micro_batch, job.train.global_batch) == (64, 2, 4)
    assert job.train.levers == levers.replace(loss_chunk_tokens=Levers().loss_chunk_tokens)
    parallel = job.topology.parallel
    assert (parallel.ulysses, parallel.ring) == (1, 2)
    model = model_source(job).config
    assert type(model).__name__ == "Qwen3Config"
    assert model.num_attention_heads == TINY["num_attention_heads"]
    choice = Choice(1, 2, 1, job.train.levers)
    assert choice in search.choices(model, search.Cluster(1, 2, 80.0, 2048.0), job)
    candidate = search.evaluate(
        Target(job, model, 2, 2, "cpu"), choice, search.Cluster(1, 2, 1.0, 64.0), {}
    )
    assert candidate.fits and candidate.footprint.peak_device > 0


def test_flag_combinations_parse():
    """Every choice of the shared flags parses (both examples use them)."""
    import argparse

    parser = argparse.ArgumentParser()
    hf_cli.add_arguments(parser)
    for mode, layout in itertools.product(("off", "on", "offload"), ("zigzag", "contiguous")):
        args = parser.parse_args(["--activation-checkpointing", mode, "--layout", layout])
        assert args.layout == layout
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-head-chunks", "0"])


@pytest.mark.parametrize("example", ["hf_trainer", "trl_sft"])
def test_the_examples_write_a_plan_config(tmp_path, example):
    """``--plan-config FILE``: the run's model, lengths and levers for ``usp plan``."""
    import trainer_cases

    from usp.train.config import load_train_config

    ckpt = trainer_cases.write_checkpoint(tmp_path / "llama", "llama")
    path = tmp_path / "plan.toml"
    flags = [
        "--model", str(ckpt), "--data", "unused.jsonl", "--output-dir", str(tmp_path),
        "--max-steps", "1", "--max-length", "512", "--batch-size", "3",
        "--gradient-accumulation", "2", "--activation-checkpointing", "on",
        "--plan-config", str(path),
    ]  # fmt: skip
    assert trainer_cases.run_example_alone(example, flags) == 0
    job = load_train_config(path)
    assert (job.train.seq_len, job.train.micro_batch, job.train.global_batch) == (512, 3, 6)
    assert job.train.activation_checkpointing is True
    assert job.model.path == str(ckpt.resolve())


def test_a_one_process_trainer_under_its_own_attention_name(tmp_path):
    """``UspTrainer(..., attention_name=)``: the name registered and switched on."""
    import trainer_cases

    ckpt = trainer_cases.write_checkpoint(tmp_path / "llama", "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    rows = [{"input_ids": list(range(6, 6 + n)), "labels": list(range(6, 6 + n))} for n in (9,) * 4]
    trainer = UspTrainer(
        model=model,
        args=_args(
            tmp_path / "out",
            max_steps=2,
            per_device_train_batch_size=2,
            logging_steps=1,
            optim="sgd",
            disable_tqdm=True,
        ),  # fmt: skip
        train_dataset=rows,
        attention_name="usp-named",
    )
    trainer.train()
    assert model.config._attn_implementation == "usp-named"
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)


def test_two_shuffled_epochs_of_the_trainer_see_two_orders(tmp_path):
    """A one-process UspTrainer over 2 epochs with the default random sampling: each
    epoch's batches are the sampler's permutation for that epoch (``seed + epoch``:
    the Trainer's ``set_epoch`` reaches the sampler), so the two orders differ and each
    holds every row once."""
    import trainer_cases

    ckpt = trainer_cases.write_checkpoint(tmp_path / "llama", "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt)
    rows = [{"input_ids": [6 + i] + [5] * 7, "labels": [6 + i] + [5] * 7} for i in range(8)]
    seen = []

    def recording_collator(features):
        seen.append([f["input_ids"][0] - 6 for f in features])
        return transformers.default_data_collator(features)

    trainer = UspTrainer(
        model=model,
        args=_args(
            tmp_path / "out",
            num_train_epochs=2,
            per_device_train_batch_size=2,
            optim="sgd",
            disable_tqdm=True,
            save_strategy="no",
            seed=11,
        ),  # fmt: skip
        train_dataset=rows,
        data_collator=recording_collator,
    )
    trainer.train()
    assert trainer.state.global_step == 8
    assert len(seen) == 8, seen
    orders = [sum(seen[:4], []), sum(seen[4:8], [])]
    assert all(sorted(order) == list(range(8)) for order in orders), seen
    for epoch, order in enumerate(orders):
        expected = torch.randperm(8, generator=torch.Generator().manual_seed(11 + epoch))
        assert order == expected.tolist(), (epoch, seen)
    assert orders[0] != orders[1]


def test_hf_trainer_example_pads_with_eos_when_the_tokenizer_has_no_pad_token(tmp_path):
    """A tokenizer without a pad token (as Meta's Llama-3 ones): the example pads text rows
    of different lengths with the EOS token, as TRL does, and the padded positions carry
    no loss: the losses equal those of the same run with a pad token, exactly. Without
    an EOS token either: one ConfigError saying what to do."""
    pytest.importorskip("datasets", reason="the example reads its data with datasets")
    import trainer_cases

    texts = trainer_cases.write_texts(tmp_path / "texts.jsonl", 8)
    losses = {}
    for name, changes in [("pad", {}), ("no-pad", {"pad_token": None})]:
        model = trainer_cases.write_checkpoint(tmp_path / name, "llama")
        tokenizer = trainer_cases.tokenizer_object()
        for key, value in changes.items():
            setattr(tokenizer, key, value)
        tokenizer.save_pretrained(model)
        reloaded = transformers.AutoTokenizer.from_pretrained(model)
        assert (reloaded.pad_token is None) == (name == "no-pad"), reloaded.pad_token
        out = tmp_path / f"out-{name}"
        argv = ["--model", str(model), "--data", str(texts), "--output-dir", str(out),
                "--max-steps", "2", "--batch-size", "4", "--sampling", "sequential",
                "--optim", "sgd", "--no-save-model"]  # fmt: skip
        assert trainer_cases.run_example_alone("hf_trainer", argv) == 0
        losses[name] = [row["loss"] for row in trainer_cases.steps_of(out)]
    assert len(losses["pad"]) == 2 and losses["no-pad"] == losses["pad"], losses
    example = trainer_cases.load_example("hf_trainer")
    bare = trainer_cases.tokenizer_object()
    bare.pad_token, bare.eos_token = None, None
    args = example.parse_args(
        ["--model", "M", "--data", "d", "--output-dir", "o", "--max-steps", "1"]
    )
    with pytest.raises(usp.ConfigError, match="neither a pad nor an EOS token.*--padding-free"):
        example.build_collator(args, bare)


@pytest.mark.parametrize("example", ["hf_trainer", "trl_sft"])
def test_the_no_usp_reference_uses_the_attention_transformers_offers(example):
    """sdpa for Llama; eager for gpt-oss, which has no sdpa (asking for it fails)."""
    import trainer_cases
    import transformers

    module = trainer_cases.load_example(example)
    shape = dict(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    oss = transformers.GptOssForCausalLM(
        transformers.GptOssConfig(**shape, num_local_experts=2, num_experts_per_tok=1)
    )
    assert module.reference_attention(llama) == "sdpa"
    assert module.reference_attention(oss) == "eager"
    oss.set_attn_implementation(module.reference_attention(oss))
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        oss.set_attn_implementation("sdpa")


def test_the_no_usp_reference_refuses_a_stock_model_that_attends_across_conversations(tmp_path):
    """examples/trl_sft.py --no-usp padding-free: a one-forward probe of the stock model
    (two conversations flattened with restarting position_ids against the second alone)
    finds gpt-oss's eager attention and Qwen3.5's Gated DeltaNet layers seeing across them
    and refuses, naming --padded; Llama's sdpa keeps them apart (0)."""
    pytest.importorskip("trl", reason="examples/trl_sft.py needs TRL")
    import trainer_cases

    example = trainer_cases.load_example("trl_sft")
    leaks = {}
    for family in ("gpt_oss", "qwen3_5", "llama"):
        directory = trainer_cases.write_checkpoint(tmp_path / family, family)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        model.set_attn_implementation(example.reference_attention(model))
        leaks[family] = example.attends_across_documents(model)
    assert leaks["gpt_oss"] > 1e-3 and leaks["qwen3_5"] > 1e-3 and leaks["llama"] < 1e-6, leaks
    chats = trainer_cases.write_chats(tmp_path / "chats.jsonl", 4)
    argv = ["--model", str(tmp_path / "gpt_oss"), "--data", str(chats), "--output-dir",
            str(tmp_path / "out"), "--max-steps", "1", "--no-usp", "--no-save-model"]  # fmt: skip
    with pytest.raises(SystemExit, match=r"gpt_oss \(eager attention\).*add --padded"):
        trainer_cases.run_example_alone("trl_sft", argv)
