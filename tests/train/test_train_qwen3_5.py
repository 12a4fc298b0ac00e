"""``usp train`` on tiny Qwen3.5 and Qwen3.5-MoE checkpoints written by transformers
(GDN and gated full-attention layers; the MoE one with a shared expert and the
load-balancing loss; the layers under SP: tests/models/test_qwen3_5.py): the step-1 loss
of one process equals transformers' float64 loss on the same tokens (each packed
document alone; 1e-5 relative, the trainer runs float32); ulysses 2 x ring 2 on 4 gloo
ranks with activation checkpointing equals the one-process run step by step (both
models in one launch; the MoE one with the GDN kernels forced to torch in its
``[attention]``); the export loads in transformers with equal logits. The GDN kernels
chosen in the config: a forced fla where it cannot run is one set-up error on every rank
(in the same launch) and in one process (``usp train --set``), and a forced fla or
causal-conv1d (their CPU stand-ins) is what the layers run."""

from __future__ import annotations

import importlib.util
import io
import json

import pytest
import torch
from fla_standin import standin_conv_kernel, standin_kernel
from launch_cases import usp_in_process
from model_cases import relative_error
from qwen3_5_cases import load_reference, write_checkpoint, write_moe_checkpoint
from train_cases import (
    _train_on_ranks,
    assert_matches_single,
    base_config,
    transformers_first_loss,
)

import usp
from usp.linear import backends, conv
from usp.train.config import train_config_from_dict
from usp.train.setup import user_errors
from usp.train.trainer import train

pytest.importorskip("transformers", minversion="5.24")
pytest.importorskip("safetensors", reason="HF checkpoints are safetensors files")
pytestmark = [pytest.mark.filterwarnings("ignore"), pytest.mark.usefixtures("one_thread")]

TIMEOUT = 400


def _job(checkpoint) -> dict:
    config = base_config(steps=2, export=True, checkpoint_interval=0)
    config["model"] = {"path": str(checkpoint)}
    config["data"] = {**config["data"], "tokenizer": "byte"}
    config["train"]["activation_checkpointing"] = True
    return config


#: the MoE job's [attention]: its GDN kernels forced to usp's torch code (on every run)
TORCH_KERNELS = {"linear_backend": "torch", "linear_conv_backend": "torch"}
#: what a forced fla on this CPU is refused with (every rank, before the model is built)
#: (the dev extra installs fla-core, whose kernels run on a CPU only under Triton's
#: interpreter: then the reason is the device)
_FLA_REASON = (
    "it runs on cuda, not cpu"
    if importlib.util.find_spec("fla") is not None
    else "it needs fla (pip install 'usp[fla]') and a CUDA device, which is not installed"
)
FLA_REFUSED = (
    '[attention] linear_backend = "fla" cannot run the Gated DeltaNet recurrence here (cpu, '
    f'torch.float32, dk=8): {_FLA_REASON}; set linear_backend = "auto" (fla where it can '
    'run, else usp\'s torch kernel) or "torch"'
)


def _train_both(configs, outs, refused):
    """Body for every rank: each job on ulysses 2 x ring 2, then the ``refused`` job's
    error (None if it trained)."""
    rows = [_train_on_ranks(config, 2, 2, out) for config, out in zip(configs, outs)]
    try:
        _train_on_ranks(refused, 2, 2, outs[0] + "-refused")
    except user_errors() as err:
        return rows, f"{type(err).__name__}: {err}"
    return rows, None


def test_usp_train_on_qwen3_5_and_qwen3_5_moe(distributed, tmp_path):
    checkpoints = {
        "qwen3_5": write_checkpoint(tmp_path / "dense", "tied", seed=11, vocab_size=256),
        "qwen3_5_moe": write_moe_checkpoint(tmp_path / "moe", seed=12, vocab_size=256),
    }
    configs, singles = {}, {}
    for family, checkpoint in checkpoints.items():
        configs[family] = _job(checkpoint)
        if family == "qwen3_5_moe":
            configs[family]["attention"] = dict(TORCH_KERNELS)
        singles[family] = train(
            train_config_from_dict(configs[family]), None, output_dir=tmp_path / f"{family}-one",
            stream=io.StringIO(),
        )  # fmt: skip
        expected = transformers_first_loss(configs[family], load=load_reference)
        first = singles[family].metrics[0]["loss"]
        assert abs(first - expected) <= 1e-5 * expected, (family, first, expected)

    outs = [str(tmp_path / f"{family}-u2r2") for family in configs]
    refused = {**configs["qwen3_5"], "attention": {"linear_backend": "fla"}}
    per_rank = distributed.run(
        _train_both, list(configs.values()), outs, refused, world_size=4, timeout=TIMEOUT
    )
    assert all(r == per_rank[0] for r in per_rank)
    assert per_rank[0][1] == (
        f"ConfigError: usp train set-up failed on ranks 0, 1, 2, 3 of 4: {FLA_REFUSED}"
    )
    assert not (tmp_path / "qwen3_5-u2r2-refused" / "checkpoints").exists(), "nothing ran"
    for rows, (family, single) in zip(per_rank[0][0], singles.items()):
        assert_matches_single(rows, single.metrics)

        exported = usp.models.from_pretrained(single.export_dir)
        assert exported.config.family == family
        hf = load_reference(single.export_dir, dtype=torch.float32)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            assert relative_error(exported(ids), hf(ids, use_cache=False).logits) <= 1e-5


CLI_JOB = """
[cluster]
nodes = 1
gpus_per_node = 1

[parallel]
ulysses = 1
ring = 1

[model]
path = "{checkpoint}"

[data]
source = "synthetic"
synthetic_documents = 16
synthetic_length = 24
document_multiple = 8
tokenizer = "byte"

[train]
steps = 2
global_batch = 2
micro_batch = 2
seq_len = 64
activation_checkpointing = false
dtype = "float32"
export = false
checkpoint_interval = 0
"""


def _usp_train(config, out, *sets) -> int:
    return usp_in_process("train", str(config), "--output", str(out), *(f"--set={s}" for s in sets))


def _losses(out) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row]


def test_usp_train_takes_the_gdn_kernels_from_the_config(tmp_path, monkeypatch, capsys):
    """``usp train CONFIG --set attention.linear_backend=...`` in one process: a forced
    fla on this CPU stops at set-up (one line, exit 2, nothing trained); with fla and
    causal-conv1d stand-ins installed (CPU, tests/helpers/fla_standin.py) the forced ones
    run every GDN layer and train as the forced torch kernels do."""
    checkpoint = write_checkpoint(tmp_path / "dense", "biased", seed=4, vocab_size=256)
    config = tmp_path / "job.toml"
    config.write_text(CLI_JOB.format(checkpoint=checkpoint))
    capsys.readouterr()
    assert _usp_train(config, tmp_path / "fla", "attention.linear_backend=fla") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and FLA_REFUSED in err, err
    assert not (tmp_path / "fla" / "metrics.jsonl").exists()

    torch_kernels = [f"attention.{key}={value}" for key, value in TORCH_KERNELS.items()]
    assert _usp_train(config, tmp_path / "torch", *torch_kernels) == 0
    fla, conv1d = standin_kernel(float64=False), standin_conv_kernel()
    monkeypatch.setattr(backends, "DEFAULT", backends.GdnKernels(backends.TorchGdnKernel(), fla))
    monkeypatch.setitem(conv.DEFAULT, "causal_conv1d", conv1d)
    forced = ["attention.linear_backend=fla", "attention.linear_conv_backend=causal_conv1d"]
    assert _usp_train(config, tmp_path / "standins", *forced) == 0
    capsys.readouterr()
    # the self-check's calls (fla: one; causal-conv1d: one per activation), then one per
    # GDN layer (2) and step (2: one micro-batch, no recompute); the backward is autograd's
    assert len(fla._function.calls) == 1 + 4 and len(conv1d._function.calls) == 2 + 4
    ours, theirs = _losses(tmp_path / "standins"), _losses(tmp_path / "torch")
    assert len(ours) == len(theirs) == 2
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= 1e-5 * b, (ours, theirs)
