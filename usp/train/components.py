"""The pieces a training run is assembled from, each built from the config: the model's
shape, the data, the model itself and the optimizer. Every check that can fail on a
config is made here, before anything heavy happens, with the file and key in the error."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from usp import options
from usp.config import ConfigError
from usp.train.config import AUTO, TrainJobConfig
from usp.train.data import (
    ByteTokenizer,
    DataError,
    PackedDataset,
    build_tokenizer,
    read_jsonl,
    synthetic_documents,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- model shape
@dataclass(frozen=True)
class ModelSource:
    config: object  # usp.models.LlamaConfig
    directory: Path | None  # the HF checkpoint directory, None for a preset


def model_source(job: TrainJobConfig) -> ModelSource:
    """The model's :class:`LlamaConfig` from ``[model]`` (a preset, or the directory's
    ``config.json``), without loading weights."""
    from usp.models import PRESETS, LlamaConfig, ModelConfigError

    m = job.model
    if m.preset is not None:
        if m.preset not in PRESETS:
            raise job.error(
                f"[model] preset {m.preset!r} is unknown; known presets: {', '.join(PRESETS)}"
            )
        try:
            config = PRESETS[m.preset].replace(**m.overrides)
        except TypeError as err:  # an unknown field
            raise job.error(f"[model.overrides] {err}") from None
        except ModelConfigError as err:
            raise job.error(f"[model.overrides] {err}") from None
        return ModelSource(config, None)
    directory = job.path(m.path)
    config_file = directory / "config.json"
    if not directory.is_dir():
        raise job.error(f"[model] path {directory} is not a directory")
    if not config_file.is_file():
        raise job.error(f"[model] path {directory} has no config.json (not an HF checkpoint)")
    try:
        return ModelSource(LlamaConfig.from_json_file(config_file), directory)
    except ModelConfigError as err:
        raise job.error(f"[model] {err}") from None


# ----------------------------------------------------------------------------- lengths
def layout_chunks(plan) -> int:
    """Every document must be a multiple of this in the plan's layout (2r or r)."""
    return options.layout_chunks(plan.layout, plan.ring_degree)


def check_lengths(job: TrainJobConfig, plan) -> int:
    """Checks ``seq_len`` against the layout; returns the document multiple to pack with."""
    seq_len, multiple = job.train.seq_len, plan.sequence_multiple
    if seq_len % multiple:
        fit = -(-seq_len // multiple) * multiple
        raise job.error(
            f"[train] seq_len({seq_len}) must be a multiple of {multiple} for the {plan.layout} "
            f"layout with ring={plan.ring_degree}, ulysses={plan.ulysses_degree}; "
            f"e.g. seq_len = {fit}"
        )
    need = layout_chunks(plan)
    document_multiple = job.data.document_multiple
    if document_multiple == AUTO:
        return need
    if document_multiple % need:
        raise job.error(
            f"[data] document_multiple({document_multiple}) must be a multiple of {need} "
            f"(every document is cut into {need} chunks by the {plan.layout} layout with "
            f"ring={plan.ring_degree})"
        )
    if seq_len % document_multiple:
        raise job.error(
            f"[train] seq_len({seq_len}) must be a multiple of [data] document_multiple"
            f"({document_multiple})"
        )
    return document_multiple


# ----------------------------------------------------------------------------- data
def build_dataset(job: TrainJobConfig, source: ModelSource, document_multiple: int):
    """The tokenizer and the packed dataset (every rank builds the same)."""
    d, t = job.data, job.train
    try:
        tokenizer = build_tokenizer(
            d.tokenizer,
            model_dir=source.directory,
            model_config=source.config,
            config_dir=job.config_dir,
        )
        if tokenizer.vocab_size > source.config.vocab_size:
            raise DataError(
                f"[data] tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                f"vocab_size({source.config.vocab_size})"
            )
        if d.source == "synthetic":
            if not isinstance(tokenizer, ByteTokenizer):
                raise DataError(
                    '[data] source = "synthetic" needs tokenizer = "byte" (or "auto" with a preset)'
                )
            documents = synthetic_documents(
                d.synthetic_documents, length=d.synthetic_length, seed=t.seed
            )
        else:
            documents = read_jsonl([job.path(f) for f in d.files], tokenizer)
        dataset = PackedDataset(
            documents,
            seq_len=t.seq_len,
            document_multiple=document_multiple,
            pad_id=tokenizer.pad_id,
            seed=t.seed,
            shuffle=d.shuffle,
        )
    except DataError as err:
        raise job.error(str(err)) from None
    return tokenizer, dataset


# ----------------------------------------------------------------------------- model
def build_model(job: TrainJobConfig, source: ModelSource, plan):
    """The model before parallelisation. A preset: float32 on the CPU, initialised from
    ``[train] seed`` identically on every rank. A checkpoint in one process: loaded on the
    CPU. A checkpoint in a distributed run: built on the meta device (no memory), to be
    sharded first and filled by :func:`load_weights` (rank 0 reads the files once and
    broadcasts, so a node holds one copy of the weights, not one per rank)."""
    from usp.models import Llama

    options = {"activation_checkpointing": job.train.activation_checkpointing}
    if source.directory is None:
        torch.manual_seed(job.train.seed)
        return Llama(source.config, plan, **options)
    if plan.topology is None:
        return Llama.from_pretrained(source.directory, plan, dtype=torch.float32, **options)
    with torch.device("meta"):
        return Llama(source.config, plan, **options)


def load_weights(model, source: ModelSource, device: torch.device) -> None:
    """Fill a sharded model built on the meta device with the checkpoint's weights
    (float32 master weights): rank 0 reads the files, every rank receives its shards.
    A collective; a checkpoint rank 0 cannot read fails on every rank alike."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from usp.comm.agreement import agree
    from usp.models import CheckpointError, Llama, ModelConfigError

    model.to_empty(device=device)
    full, error = {}, None
    if dist.get_rank() == 0:
        try:
            full = Llama.from_pretrained(source.directory, None, dtype=torch.float32).state_dict()
        except (CheckpointError, ModelConfigError, OSError) as err:
            error = CheckpointError(str(err))
    agree(dist.group.WORLD, f"loading {source.directory}", [], error, (CheckpointError,))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)


def compute_dtype(job: TrainJobConfig, device: torch.device) -> torch.dtype:
    if job.train.dtype == AUTO:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[job.train.dtype]


def build_optimizer(job: TrainJobConfig, model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms)."""
    t = job.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=t.lr, betas=t.adam_betas, eps=t.adam_eps)


def resolve_device(job: TrainJobConfig, plan) -> torch.device:
    """The plan's device for a distributed run; for one process, ``[train] device``."""
    if plan.topology is not None:
        device = plan.default_device()
        if job.train.device not in (AUTO, device.type):
            raise ConfigError(
                f"{job.source}: [train] device = {job.train.device!r} but the process group "
                f"runs on {device.type}"
            )
        return device
    wanted = job.train.device
    if wanted == AUTO:
        wanted = "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise job.error('[train] device = "cuda" but CUDA is not available')
    return torch.device(wanted)
