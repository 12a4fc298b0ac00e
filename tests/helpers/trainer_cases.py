"""Shared pieces of the HF Trainer / TRL integration tests: a tiny checkpoint with a
character-level tokenizer and a chat template, JSON-lines data, the examples as modules,
transformers' environment for the pooled ranks, and reading what a run left.

The pooled ranks already run in one gloo world (tests/helpers/dist_harness.py);
accelerate learns that world from the variables torchrun would set
(:func:`accelerate_world`), and its shared state is reset afterwards so the next run
starts clean."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CHARS = "abcdefghijklmnopqrstuvwxyz .,?!'"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
WORDS = [
    "ring",
    "ulysses",
    "heads",
    "tokens",
    "shard",
    "rank",
    "node",
    "batch",
    "loss",
    "sum",
    "mean",
    "step",
]


def tokenizer_object():
    """A character-level tokenizer (38 ids, inside the tiny vocabulary of 64) with the
    chat template above."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.add_special_tokens(SPECIALS)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_tokenizer(directory: Path) -> None:
    """:func:`tokenizer_object`, saved as transformers saves one."""
    tokenizer_object().save_pretrained(directory)


def write_checkpoint(directory: Path, family: str, **changes) -> Path:
    """A tiny random model of ``family`` (tests/helpers/model_cases.py; ``gemma3``:
    tests/helpers/gemma3_cases.py's "tied" case, sliding windows of 5 tokens; ``qwen3_5``:
    tests/helpers/qwen3_5_cases.py's "biased" case; ``qwen3_5_moe``: its MoE case) and the
    tokenizer, in one HF directory."""
    if family == "gemma3":
        import gemma3_cases

        gemma3_cases.write_checkpoint(directory, "tied", seed=5, **changes)
    elif family == "qwen3_5":  # Gated DeltaNet layers 0 and 2 (conv kernel 3), biases
        import qwen3_5_cases

        qwen3_5_cases.write_checkpoint(directory, "biased", seed=5, **changes)
    elif family == "qwen3_5_moe":  # the same layers, 4 experts and a shared one, aux loss on
        import qwen3_5_cases

        qwen3_5_cases.write_moe_checkpoint(directory, seed=5, **changes)
    else:
        from model_cases import write_family_checkpoint

        write_family_checkpoint(directory, family, seed=5, **changes)
    write_tokenizer(directory)
    return Path(directory)


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_chats(path: Path, count: int, *, seed: int = 0) -> Path:
    """``count`` conversations of different lengths (16 to about 60 tokens)."""
    rng = random.Random(seed)
    rows = [
        {
            "messages": [
                {"role": "user", "content": _sentence(rng, rng.randint(1, 4)) + "?"},
                {"role": "assistant", "content": _sentence(rng, rng.randint(1, 6)) + "."},
            ]
        }
        for _ in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_texts(path: Path, count: int, *, seed: int = 0) -> Path:
    """``count`` text rows of different lengths (so the collator pads)."""
    rng = random.Random(seed)
    rows = [{"text": _sentence(rng, rng.randint(2, 8)) + "."} for _ in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_token_rows(path: Path, count: int, length: int, *, seed: int = 0) -> Path:
    """``count`` rows of ``length`` random token ids (no tokenizer needed)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [
        {"input_ids": torch.randint(6, 38, (length,), generator=gen).tolist()} for _ in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load_example(name: str):
    """``examples/<name>.py`` as a module (its ``main(argv, plan=...)``)."""
    spec = importlib.util.spec_from_file_location(
        f"usp_example_{name}", ROOT / "examples" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state (the next Trainer sets it up again)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@contextlib.contextmanager
def accelerate_world():
    """torchrun's variables for this pooled rank (the gloo world already exists), and a
    clean accelerate state after."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "OMP_NUM_THREADS": "1",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        reset_accelerate()


def run_example_on_ranks(
    name: str, argv: list[str], ulysses: int, ring: int, layout="zigzag", planted=None
):
    """A pooled-rank body: the example on this world's ``ulysses x ring`` plan (the
    topology cached per worker). ``planted``: a bug to plant for the run (see
    :data:`PLANTED`)."""
    from usp_cases import topology

    import usp

    plan = usp.Plan(topology(ulysses, ring), layout=layout)
    with accelerate_world(), PLANTED.get(planted, contextlib.nullcontext)():
        return load_example(name).main(argv, plan=plan)


@contextlib.contextmanager
def _averaged_sp_gradients():
    """FSDP2 divides the summed gradients by the SP degree: the SP ranks' gradients
    averaged (as DDP or a default FSDP over the SP ranks would), not summed."""
    from torch.distributed.fsdp import FSDPModule

    import usp.integrations.hf_setup as setup

    exact = setup.fully_shard_model

    def planted(model, topology, **options):
        sharded = exact(model, topology, **options)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(float(topology.sp_degree))
        return sharded

    setup.fully_shard_model = planted
    try:
        yield
    finally:
        setup.fully_shard_model = exact


@contextlib.contextmanager
def _replica0_samples_by_rank():
    """The ranks of data-parallel replica 0 sample by their global rank (as a loader
    that shards by process would): each gets other samples; replica 1 is right."""
    import usp.integrations.hf_trainer as trainer

    exact = trainer.DataParallelSampler

    def planted(length, *, dp_rank=0, dp_degree=1, **options):
        import torch.distributed as dist

        if dp_rank == 0:
            dp_rank, dp_degree = dist.get_rank(), dist.get_world_size()
        return exact(length, dp_rank=dp_rank, dp_degree=dp_degree, **options)

    trainer.DataParallelSampler = planted
    try:
        yield
    finally:
        trainer.DataParallelSampler = exact


#: bugs a test plants for one run, by name
PLANTED = {
    "average_sp_gradients": _averaged_sp_gradients,
    "replica0_samples_by_rank": _replica0_samples_by_rank,
}


def run_example_alone(name: str, argv: list[str]) -> int:
    """The example in this process, as ``python examples/<name>.py`` runs it."""
    try:
        return load_example(name).main(argv)
    finally:
        reset_accelerate()


def state_of(output_dir: Path) -> dict:
    """``DIR/trainer_state.json``."""
    return json.loads((Path(output_dir) / "trainer_state.json").read_text())


def steps_of(output_dir: Path) -> list[dict]:
    """The per-step rows (loss, grad_norm, ...) of ``DIR/trainer_state.json``."""
    return [row for row in state_of(output_dir)["log_history"] if "loss" in row]


def eval_losses_of(output_dir: Path) -> list[float]:
    """Every ``eval_loss`` of ``DIR/trainer_state.json``, in order."""
    rows = state_of(output_dir)["log_history"]
    return [row["eval_loss"] for row in rows if "eval_loss" in row]


def weights_of(output_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(output_dir) / "model.safetensors")
