"""What ``usp eval`` evaluates: a training output directory (its newest complete DCP
checkpoint) or an HF export, loaded whole onto every rank; its tokenizer; the held-out
documents.

``TARGET`` is one of:

- an HF-format directory (``config.json`` + safetensors; what ``usp train`` exports to
  ``OUTPUT/hf``): the model of its ``config.json``;
- a training output directory (``OUTPUT/checkpoints/step_*``): its newest complete
  checkpoint, with the model that ``--config`` (the training config) describes, its
  ``[model]`` position settings included; the shape is checked against the checkpoint's;
- one checkpoint directory ``OUTPUT/checkpoints/step_N`` (also with ``--config``).

Forward only needs no optimizer and no FSDP: every rank holds the whole model (in
``dtype``), and sequence parallelism splits the activations, which is what grows with
the length. DCP checkpoints carry pickled metadata: load them only from a trusted
source.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from usp.errors import CheckpointError, DataError, ModelConfigError
from usp.models import DecoderConfig, config_from_file, family_of, from_pretrained
from usp.train.checkpoint import META_FILE, Checkpointer
from usp.train.components import model_source
from usp.train.data import build_tokenizer, read_jsonl, synthetic_documents
from usp.train.evaluate import resolve_held_out

#: the seed offset of generated held-out documents (a synthetic [data] trains on seed s)
HELD_OUT_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Target:
    """A resolved ``TARGET``: the model's config and where its weights are."""

    path: Path  # what the user named
    config: DecoderConfig
    hf_dir: Path | None = None  # an HF export, or
    checkpoint: Path | None = None  # a DCP checkpoint directory (step_N)
    model_dir: Path | None = None  # where "auto" looks for tokenizer.json

    def describe(self) -> str:
        if self.hf_dir is not None:
            return f"HF checkpoint {self.hf_dir}"
        return f"training checkpoint {self.checkpoint}"


def resolve_target(path: str | Path, job=None) -> Target:
    """``path`` as a :class:`Target` (module docstring); ``job``: the training config
    (needed for a DCP checkpoint). A :class:`CheckpointError` says what was expected."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise CheckpointError(
            f"usp eval TARGET {path} is not a directory: give a training output directory, "
            "one of its checkpoints/step_N, or an HF-format model directory"
        )
    if (path / "config.json").is_file():
        return Target(path, _read_config(path / "config.json"), hf_dir=path, model_dir=path)
    if (path / META_FILE).is_file():
        checkpoint = path
    elif (path / "checkpoints").is_dir():
        checkpoint = None
    else:
        raise CheckpointError(
            f"{path} holds neither config.json (an HF model) nor checkpoints/ (a training "
            f"output directory) nor {META_FILE} (one checkpoint)"
        )
    if job is None:
        raise CheckpointError(
            f"{path} is a training output: pass --config with the training config that wrote "
            "it (its [model] is the model's shape and position settings)"
        )
    source = model_source(job)
    directory = checkpoint.parent if checkpoint is not None else path / "checkpoints"
    checkpointer = Checkpointer(directory, model_config=source.config)
    if checkpoint is None:
        complete = checkpointer.complete()
        if not complete:
            raise CheckpointError(
                f"{directory} holds no complete checkpoint (none with {META_FILE}); "
                f"{_export_hint(path)}"
            )
        checkpoint = complete[-1][1]
    checkpointer.read_meta(checkpoint)  # another model shape fails here, naming the fields
    return Target(path, source.config, checkpoint=checkpoint, model_dir=source.directory)


def _export_hint(path: Path) -> str:
    hf = path / "hf"
    return f"evaluate its HF export instead: usp eval {hf}" if hf.is_dir() else "train first"


def _read_config(file: Path) -> DecoderConfig:
    try:
        return config_from_file(file)
    except ModelConfigError as err:
        raise CheckpointError(f"{file}: {err}") from None


# ----------------------------------------------------------------------------- the model
def load_model(target: Target, plan, device: torch.device, dtype: torch.dtype):
    """The whole model on ``device`` in ``dtype`` on every rank, in eval mode. The one
    place ``usp eval`` builds a model (of the config's family)."""
    if target.hf_dir is not None:
        model = from_pretrained(target.hf_dir, plan, dtype=dtype, device=device)
        return model.eval()
    with torch.device("meta"):
        model = family_of(target.config).build(target.config, plan)
    model.to_empty(device=device)  # float32, as the master weights were saved
    state = {"model": model.state_dict()}
    try:
        with _quiet_dcp():
            # every rank reads the whole model for itself (no collective)
            dcp.load(state, checkpoint_id=str(target.checkpoint), no_dist=True)
    except (RuntimeError, ValueError, OSError, KeyError) as err:
        raise CheckpointError(f"reading the model from {target.checkpoint} failed: {err}") from None
    model.load_state_dict(state["model"], strict=True)
    return model.to(dtype).eval()


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns on every load with ``no_dist`` that it assumes one process: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message=".*no_dist.*")
        yield


# ----------------------------------------------------------------------------- text
def eval_tokenizer(target: Target, job=None, spec: str | None = None):
    """``--tokenizer`` (``"byte"``, a path), else ``--config``'s ``[data] tokenizer`` (as
    training read it: "auto" is its ``[model]``'s), else the model directory's
    ``tokenizer.json``."""
    model_dir = target.model_dir
    if spec is None and job is not None:
        spec, base = job.data.tokenizer, job.config_dir
        model_dir = job.path(job.model.path) if job.model.path is not None else None
    else:
        spec, base = spec or "auto", Path.cwd()
    try:
        tokenizer = build_tokenizer(
            spec, model_dir=model_dir, model_config=target.config, config_dir=base
        )
    except DataError as err:
        raise DataError(f"{err} (usp eval: --tokenizer byte|PATH chooses one)") from None
    if tokenizer.vocab_size > target.config.vocab_size:
        raise DataError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
            f"vocab_size({target.config.vocab_size}); give the model's own (--tokenizer)"
        )
    return tokenizer


def held_out_stream(tokenizer, *, data: list[str] | None = None, job=None):
    """``(tokens, target, description)``: the held-out documents concatenated in order
    (int64 [N], and bool [N]: which tokens carry a loss, as their format says). From ``--data`` files (relative to the working directory), else ``--config``'s
    ``[eval] files``, else, for a synthetic ``[data]``, freshly generated documents of
    that task (another seed than the training set's). Training files are never used."""
    if data:
        files = resolve_held_out(data, Path.cwd(), "--data")
    elif job is not None and job.eval is not None:
        files = resolve_held_out(job.eval.files, job.config_dir, "[eval] files")
    elif job is not None and job.data.source == "synthetic":
        d, seed = job.data, job.train.seed + HELD_OUT_SEED_OFFSET
        docs = synthetic_documents(
            d.synthetic_documents, length=d.synthetic_length, seed=seed, tokenizer=tokenizer
        )
        what = f"{len(docs)} generated documents of the [data] synthetic task (seed {seed})"
        return (*_concatenate(docs), what)
    else:
        raise DataError(
            "usp eval needs held-out documents for the perplexity: --data FILES (JSONL, the "
            "formats of [data] files), or --config with [eval] files (its [data] files are "
            "training data, not held out)"
        )
    docs, _ = read_jsonl(files, tokenizer)  # no length limit: windows cut the stream
    names = ", ".join(map(str, files)) if len(files) <= 3 else f"{len(files)} files"
    return (*_concatenate(docs), f"{len(docs)} documents from {names}")


def _concatenate(docs) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([d.tokens for d in docs]), torch.cat([d.target for d in docs])
