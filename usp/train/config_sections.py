"""The sections of a training config: ``[model]``, ``[data]``, ``[train]`` and ``[eval]``.

Each is a frozen dataclass whose ``__post_init__`` checks every field with
:mod:`usp.config.fields`' validators and says what would be valid; the file, its
overrides and the job they form are :mod:`usp.train.config`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from usp.config import (
    AUTO,
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_string,
    fail,
    is_number,
)
from usp.models.levers import LeverError, Levers
from usp.models.lora import Lora, LoraError, lora_from_table
from usp.models.rope_config import POSITION_FIELDS

DATA_SOURCES = ("jsonl", "synthetic")
#: [train] dtype: "auto" or a torch dtype's name (usp.train.components.TORCH_DTYPES maps
#: them; usp.cli.args.DTYPE_NAMES names them for `usp eval` without loading torch)
DTYPE_CHOICES = (AUTO, "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LONG_DOCUMENTS = ("truncate", "split", "drop", "error")
#: [train] report_to: where metrics go besides metrics.jsonl (usp.train.report_to)
REPORT_TO = ("tensorboard", "wandb")

# The sections below validate with usp.config's field validators (one set for every
# section), under the short local names their checks were written with.
_is_number = is_number
_fail = fail
_int = check_int
_number = check_number
_bool = check_bool
_choice = check_choice
_string = check_string


# ----------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class ModelSection:
    """Where the weights come from: a local HF directory, or a preset with random init."""

    path: str | None = None
    preset: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    # position settings (context extension), for a checkpoint or a preset; None: as is
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None  # {rope_type = "yarn", factor = 4.0, ...}
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.preset is None):
            raise ConfigError(
                "[model] needs exactly one of path (a local HF checkpoint directory) or "
                'preset (e.g. "tiny"), got ' + ("both" if self.path is not None else "neither")
            )
        if self.path is not None:
            _string("model", "path", self.path)
        if self.preset is not None:
            _string("model", "preset", self.preset)
        if not isinstance(self.overrides, dict):
            _fail("model", "overrides", "a table of the preset's config fields", self.overrides)
        if self.overrides and self.path is not None:
            raise ConfigError(
                "[model] overrides only apply to a preset; a checkpoint's shape comes from "
                "its config.json (its position settings may change: [model] rope_theta, "
                "rope_scaling, max_position_embeddings)"
            )
        if self.rope_theta is not None:
            _number("model", "rope_theta", self.rope_theta, minimum=0, strict=True)
        if self.rope_scaling is not None and not (
            isinstance(self.rope_scaling, dict)
            and isinstance(self.rope_scaling.get("rope_type"), str)
        ):
            _fail(
                "model",
                "rope_scaling",
                'a table with a rope_type ("default", "linear", "llama3", "yarn")',
                self.rope_scaling,
            )
        if self.max_position_embeddings is not None:
            _int("model", "max_position_embeddings", self.max_position_embeddings, minimum=1)
        twice = [k for k in self.position_settings if k in self.overrides]
        if twice:
            raise ConfigError(
                f"[model] {twice[0]} is given twice, in [model] and [model.overrides]; keep one"
            )

    @property
    def position_settings(self) -> dict[str, Any]:
        """The position settings given (rope_theta, rope_scaling, max_position_embeddings)."""
        return {k: getattr(self, k) for k in POSITION_FIELDS if getattr(self, k) is not None}


@dataclass(frozen=True)
class DataSection:
    """Where the training sequences come from and how documents are packed."""

    source: str = "jsonl"
    files: tuple[str, ...] = ()
    tokenizer: str = AUTO  # "auto": the model directory's tokenizer.json; "byte"; a path
    shuffle: bool = True
    # Each document is padded to a multiple of this before packing ("auto": what the
    # layout needs, 2*ring for zigzag). A fixed value makes the packed stream the same
    # for every topology whose need divides it (compare runs across degrees).
    document_multiple: int | str = AUTO
    synthetic_documents: int = 2048  # size of the generated data set
    synthetic_length: int = 40  # longest prompt of a generated document, in tokens
    # Documents longer than [train] seq_len: "truncate" (keep the first token and the
    # end when every trained token fits, so a prompt's start is cut and its completion
    # kept; else cut the end), "split" (pieces of seq_len), "drop", or "error".
    long_documents: str = "truncate"

    def __post_init__(self) -> None:
        _choice("data", "source", self.source, DATA_SOURCES)
        files = self.files
        if isinstance(files, str):
            files = (files,)
        if not (isinstance(files, (list, tuple)) and all(isinstance(f, str) for f in files)):
            _fail("data", "files", "a path or a list of paths", self.files)
        object.__setattr__(self, "files", tuple(files))
        if self.source == "jsonl" and not self.files:
            raise ConfigError('[data] files is required when source = "jsonl"')
        if self.source == "synthetic" and self.files:
            raise ConfigError('[data] files is not used when source = "synthetic"; remove it')
        _string("data", "tokenizer", self.tokenizer)
        _bool("data", "shuffle", self.shuffle)
        _int("data", "document_multiple", self.document_multiple, minimum=1, auto=True)
        _int("data", "synthetic_documents", self.synthetic_documents, minimum=1)
        _int("data", "synthetic_length", self.synthetic_length, minimum=2)
        _choice("data", "long_documents", self.long_documents, LONG_DOCUMENTS)


@dataclass(frozen=True)
class TrainSection:
    """Optimisation, precision, intervals and where outputs go."""

    steps: int
    global_batch: int  # sequences per optimizer step, over all dp replicas
    seq_len: int  # tokens per packed sequence (global, before sequence parallelism)
    micro_batch: int = 1  # sequences per forward pass on one dp replica
    gradient_accumulation: int | str = AUTO  # "auto": global_batch / (dp * micro_batch)
    lr: float = 3e-4
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0
    dtype: str = AUTO  # compute dtype; "auto": bfloat16 on CUDA, float32 on CPU
    activation_checkpointing: bool | str = False  # true, false or "offload" (host memory)
    checkpoint_interval: int = 0  # optimizer steps; 0: only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept in output_dir/checkpoints
    log_interval: int = 1  # steps between progress lines when no progress bar is shown
    export: bool = True  # write an HF checkpoint (output_dir/hf) at the end
    output_dir: str = AUTO  # "auto": runs/<config file name>
    device: str = AUTO  # "auto": cuda when available, else cpu
    peak_tflops: float | str = AUTO  # per device, for MFU; "auto": from the device name
    mlp_tile_tokens: int = 0  # 0: off; N: each MLP runs over tiles of N local tokens
    attention_head_chunks: int = 1  # N: the ring attends to N groups of KV heads in turn
    max_skipped_steps: int = 0  # steps with a non-finite loss/grad norm skipped before stopping
    collective_timeout_s: float = 600.0  # any collective waiting longer for a peer fails
    compile: bool = False  # torch.compile each decoder layer (usp.train.parallelize)
    # metrics also to TensorBoard (output_dir/tensorboard) and/or W&B, from rank 0
    report_to: tuple[str, ...] = ()
    # training state in host memory: AdamW's state and step; with
    # offload_parameters also the sharded parameters and gradients (FSDP2 CPUOffloadPolicy)
    offload_optimizer: bool = False
    offload_parameters: bool = False
    # LoRA (usp.models.lora): {rank, alpha, dropout, targets}; a table ({} = defaults),
    # true (the defaults) or false/absent (every weight trained)
    lora: Lora | None = None

    @property
    def levers(self) -> Levers:
        """The memory levers these keys ask for (activation_checkpointing,
        mlp_tile_tokens, attention_head_chunks, offload_optimizer, offload_parameters),
        as the one :class:`usp.models.Levers` the trainer and the planner pass on."""
        return self._levers

    def __post_init__(self) -> None:
        s = "train"
        for key in ("steps", "global_batch", "seq_len", "micro_batch", "keep_checkpoints"):
            _int(s, key, getattr(self, key), minimum=1)
        for key in ("warmup_steps", "seed", "checkpoint_interval"):
            _int(s, key, getattr(self, key), minimum=0)
        _int(s, "log_interval", self.log_interval, minimum=1)
        _int(s, "gradient_accumulation", self.gradient_accumulation, minimum=1, auto=True)
        _number(s, "lr", self.lr, minimum=0, strict=True)
        _number(s, "weight_decay", self.weight_decay, minimum=0)
        _number(s, "adam_eps", self.adam_eps, minimum=0, strict=True)
        _number(s, "grad_clip", self.grad_clip, minimum=0)
        if not (_is_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            _fail(s, "min_lr_ratio", "a number in [0, 1]", self.min_lr_ratio)
        betas = self.adam_betas
        if not (
            isinstance(betas, (list, tuple))
            and len(betas) == 2
            and all(_is_number(b) and 0 <= b < 1 for b in betas)
        ):
            _fail(s, "adam_betas", "two numbers in [0, 1), e.g. [0.9, 0.95]", betas)
        object.__setattr__(self, "adam_betas", tuple(float(b) for b in betas))
        _choice(s, "dtype", self.dtype, DTYPE_CHOICES)
        _choice(s, "device", self.device, DEVICES)
        _bool(s, "export", self.export)
        _string(s, "output_dir", self.output_dir)
        if self.peak_tflops != AUTO:
            _number(s, "peak_tflops", self.peak_tflops, minimum=0, strict=True)
        _int(s, "max_skipped_steps", self.max_skipped_steps, minimum=0)
        _number(s, "collective_timeout_s", self.collective_timeout_s, minimum=0, strict=True)
        _bool(s, "compile", self.compile)
        report_to = (self.report_to,) if isinstance(self.report_to, str) else self.report_to
        if not (
            isinstance(report_to, (list, tuple))
            and all(isinstance(r, str) and r in REPORT_TO for r in report_to)
            and len(set(report_to)) == len(report_to)
        ):
            expected = "a list of distinct names among " + ", ".join(f'"{r}"' for r in REPORT_TO)
            _fail(s, "report_to", expected, self.report_to)
        object.__setattr__(self, "report_to", tuple(report_to))
        # the memory levers: validated once, by the Levers they form (usp.models.levers)
        try:
            levers = Levers(
                activation_checkpointing=self.activation_checkpointing,
                mlp_tile_tokens=self.mlp_tile_tokens,
                attention_head_chunks=self.attention_head_chunks,
                offload_optimizer=self.offload_optimizer,
                offload_parameters=self.offload_parameters,
            )
        except LeverError as err:
            if err.key is None:
                raise ConfigError(f"[{s}] {err}") from None
            _fail(s, err.key, err.expected, err.value)  # worded as every [train] key's error
        object.__setattr__(self, "_levers", levers)
        try:
            object.__setattr__(self, "lora", lora_from_table(self.lora))
        except LoraError as err:
            raise ConfigError(f"[{s}] {err}") from None


@dataclass(frozen=True)
class EvalSection:
    """A held-out loss during training (:mod:`usp.train.evaluate`): the documents of
    ``files`` (the formats of ``[data] files``) go through the training data's tokenizer,
    ``long_documents`` policy and packing (in file order, not shuffled) and are never
    trained on; every ``every`` optimizer steps, and after the last one, the mean loss
    over all their label tokens is computed (forward only) and written to
    ``metrics.jsonl``. ``max_batches``: evaluate only the first N batches of
    ``[train] global_batch`` packed sequences (None: all of them)."""

    files: tuple[str, ...]
    every: int
    max_batches: int | None = None

    def __post_init__(self) -> None:
        files = (self.files,) if isinstance(self.files, str) else self.files
        if not (
            isinstance(files, (list, tuple)) and files and all(isinstance(f, str) for f in files)
        ):
            _fail("eval", "files", "a path or a non-empty list of paths", self.files)
        object.__setattr__(self, "files", tuple(files))
        _int("eval", "every", self.every, minimum=1)
        if self.max_batches is not None:
            _int("eval", "max_batches", self.max_batches, minimum=1)

    def due(self, step: int, last_step: int) -> bool:
        """Whether an evaluation follows optimizer step ``step`` of a run of ``last_step``."""
        return step % self.every == 0 or step == last_step
