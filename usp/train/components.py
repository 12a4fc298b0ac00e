"""The pieces a training run is assembled from, each built from the config: the model's
shape, the data, the model itself and the optimizer. Every check that can fail on a
config is made here, before anything heavy happens, with the file and key in the error."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from usp import options
from usp.comm.agreement import agree
from usp.config import ConfigError, UspConfig
from usp.models import (
    PRESETS,
    CheckpointError,
    LeverError,
    Levers,
    LoraError,
    ModelConfigError,
    apply_lora,
    config_from_file,
    document_cost,
    family_of,
    lora_of,
)
from usp.models.lora import initial_adapters
from usp.models.offload import HostOffloader
from usp.process_groups import Topology
from usp.sp.plan import Plan
from usp.train.config import AUTO, DTYPE_CHOICES, TrainJobConfig
from usp.train.data import (
    ByteTokenizer,
    DataError,
    PackedDataset,
    build_tokenizer,
    resolve_files,
)
from usp.train.data.build import DataInputs, describe_files, packed_dataset
from usp.train.host_optimizer import HostAdamW
from usp.train.parallelize import compile_layers, parameters_device

#: the torch dtype of each ``[train] dtype`` name other than "auto" (its choices name them)
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_CHOICES if name != AUTO}


# ----------------------------------------------------------------------------- model shape
@dataclass(frozen=True)
class ModelSource:
    config: object  # a usp.models.DecoderConfig of one family (usp.models.family)
    directory: Path | None  # the HF checkpoint directory, None for a preset
    #: "name: old -> new" for each [model] position setting that changed the config
    changes: tuple[str, ...] = ()
    #: the directory's config.json as read (before the position settings), so that
    #: loading the weights does not read it again (None for a preset)
    file_config: object | None = None


def model_source(job: TrainJobConfig) -> ModelSource:
    """The model's config from ``[model]`` (a preset, or the directory's ``config.json``,
    read by the family it names), without loading weights."""
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
        return _with_positions(job, ModelSource(config, None))
    directory = job.path(m.path)
    config_file = directory / "config.json"
    if not directory.is_dir():
        raise job.error(f"[model] path {directory} is not a directory")
    if not config_file.is_file():
        raise job.error(f"[model] path {directory} has no config.json (not an HF checkpoint)")
    try:
        config = config_from_file(config_file)
        source = ModelSource(config, directory, file_config=config)
    except ModelConfigError as err:
        raise job.error(f"[model] {err}") from None
    return _with_positions(job, source)


def _with_positions(job: TrainJobConfig, source: ModelSource) -> ModelSource:
    """``source`` with the ``[model]`` position settings applied (context extension)."""
    if not job.model.position_settings:
        return source
    try:
        config = source.config.with_positions(**job.model.position_settings)
    except ModelConfigError as err:
        raise job.error(f"[model] {err}") from None
    changes = tuple(source.config.position_changes(config))
    return ModelSource(config, source.directory, changes, source.file_config)


def topology_config(job: TrainJobConfig, source: ModelSource | None = None) -> UspConfig:
    """The job's topology config with the model's head counts as its ``[model]``, so
    ``ulysses = "auto"`` and the head checks see the real model (what ``usp topo`` shows
    and what ``usp train`` builds its topology from). ``source``: the job's
    :func:`model_source` if read already (else read here: a :class:`ConfigError` when
    the model's config cannot be read)."""
    config = (model_source(job) if source is None else source).config
    return job.topology_with_heads(
        config.num_attention_heads, config.num_key_value_heads, config.attention_head_dim
    )


#: The trainer's ``verify_calls`` (usp train and :func:`usp.train.trainer.train` alike):
#: off, because the trainer makes every batch itself, identically on all SP ranks, and
#: ``Plan.pack`` agrees on each batch's documents; agreeing per attention call as well
#: would only add a collective per layer.
TRAIN_VERIFY_CALLS = False


def build_plan(
    job: TrainJobConfig,
    topology: Topology | None | str = "build",
    *,
    source: ModelSource | None = None,
) -> Plan:
    """The Plan a training job runs on (:meth:`Plan.from_config` with
    :data:`TRAIN_VERIFY_CALLS`). ``"build"``: the topology from the config, with the
    model's head counts checked (a collective: every rank calls it after
    ``init_process_group``); a Topology: that one, whose degrees must match the
    config's; None: one process. ``source``: as in :func:`topology_config`."""
    config = topology_config(job, source) if isinstance(topology, str) else job.topology
    plan = Plan.from_config(config, topology=topology, verify_calls=TRAIN_VERIFY_CALLS)
    if plan.placement == "documents":  # balanced for this model's work
        source = model_source(job) if source is None else source
        plan = plan.with_options(placement_cost=document_cost(source.config))
    return plan


# ----------------------------------------------------------------------------- lengths
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
    need = options.layout_chunks(plan.layout, plan.ring_degree)  # a document's chunks: 2r or r
    documents = getattr(plan, "placement", "sequence") == "documents"
    if documents:  # any document may be split over the SP group, which needs this
        need = multiple
    document_multiple = job.data.document_multiple
    if document_multiple == AUTO:
        return need
    if document_multiple % need:
        why = (
            f'a document split over the SP group (placement = "documents") is placed like '
            f"a dense sequence on ring={plan.ring_degree}, ulysses={plan.ulysses_degree}"
            if documents
            else f"every document is cut into {need} chunks by the {plan.layout} layout "
            f"with ring={plan.ring_degree}"
        )
        raise job.error(
            f"[data] document_multiple({document_multiple}) must be a multiple of {need} ({why})"
        )
    if seq_len % document_multiple:
        raise job.error(
            f"[train] seq_len({seq_len}) must be a multiple of [data] document_multiple"
            f"({document_multiple})"
        )
    return document_multiple


# ----------------------------------------------------------------------------- data
def prepare_data(job: TrainJobConfig, source: ModelSource, document_multiple: int) -> DataInputs:
    """``[data]`` checked without tokenising anything: the tokenizer loads, the files (globs
    expanded) exist. Every rank can run it alone (no collective)."""
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
        synthetic, files = None, ()
        if d.source == "synthetic":
            if not isinstance(tokenizer, ByteTokenizer):
                raise DataError(
                    '[data] source = "synthetic" needs tokenizer = "byte" (or "auto" with a preset)'
                )
            synthetic = (d.synthetic_documents, d.synthetic_length, t.seed)
        else:
            files = tuple(resolve_files(d.files, job.config_dir))
    except DataError as err:
        raise job.error(str(err), type(err)) from None
    return DataInputs(
        tokenizer,
        files,
        seq_len=t.seq_len,
        long_documents=d.long_documents,
        document_multiple=document_multiple,
        seed=t.seed,
        shuffle=d.shuffle,
        synthetic=synthetic,
    )


def load_dataset(
    job: TrainJobConfig, inputs: DataInputs, *, topology=None, cache_root: Path | None = None
) -> PackedDataset:
    """The packed dataset: the files tokenised once into ``cache_root`` (every rank of
    ``topology`` calls this; see :mod:`usp.train.data.build`), or in memory without one.
    ``dataset.notes`` says what was read and done; ``dataset.fingerprint`` is the cache key."""
    try:
        built, dataset = packed_dataset(
            inputs, shuffle=inputs.shuffle, topology=topology, cache_root=cache_root
        )
    except DataError as err:
        raise job.error(str(err), type(err)) from None
    where = describe_files(inputs.files) if inputs.files else "synthetic"
    dataset.notes = [f"from {where}; tokenizer {inputs.tokenizer.describe()}", *built.notes]
    dataset.fingerprint = built.key
    return dataset


def build_dataset(
    job: TrainJobConfig,
    source: ModelSource,
    document_multiple: int,
    *,
    topology=None,
    cache_root: Path | None = None,
):
    """The tokenizer and the packed dataset: :func:`prepare_data` then :func:`load_dataset`."""
    inputs = prepare_data(job, source, document_multiple)
    return inputs.tokenizer, load_dataset(job, inputs, topology=topology, cache_root=cache_root)


# ----------------------------------------------------------------------------- model
def check_compile(job: TrainJobConfig, source: ModelSource, plan) -> None:
    """``[train] compile = true`` on a family whose layers do not compile whole under
    ``plan`` yet (:meth:`usp.models.family.ModelFamily.compile_refusal`: sliding windows
    on an all-gather ring, GDN layers anywhere): refused at set-up, on every rank alike
    (the plan's choices are the same on every rank) and before any collective, rather
    than at the first forward's trace."""
    family = family_of(source.config)
    if job.train.compile and getattr(plan, "placement", "sequence") == "documents":
        raise job.error(
            '[train] compile = true does not support [parallel] token_placement = "documents" '
            "yet (its attention runs eagerly: a split part and a whole-documents part per "
            'rank); set compile = false, or token_placement = "sequence"'
        )
    refusal = family.compile_refusal(plan, source.config) if job.train.compile else None
    if refusal is not None:
        raise job.error(
            f"[train] compile = true does not support {family.name} models here yet: "
            f"{refusal}; or set [train] compile = false for {family.name} models"
        )


def check_kernels(job: TrainJobConfig, source: ModelSource, plan, device) -> None:
    """A kernel ``[attention]`` forces for the model's Gated DeltaNet layers
    (``linear_backend = "fla"``, ``linear_conv_backend = "causal_conv1d"``) that cannot
    run them on ``device`` in the run's dtype (not installed, not CUDA, ...): refused at
    set-up, on every rank alike and before any collective, rather than at the first
    forward. Its self-check still runs at the first call."""
    family = family_of(source.config)
    refusal = family.kernel_refusal(source.config, plan, device, compute_dtype(job, device))
    if refusal is not None:
        raise job.error(f"[attention] {refusal}")


def build_model(
    job: TrainJobConfig,
    source: ModelSource,
    plan,
    levers: Levers | None = None,
    *,
    offloader: HostOffloader | None = None,
):
    """The model of the source's family before parallelisation, with ``levers`` applied
    (default: ``[train]``'s, ``job.train.levers``; ``offloader``: as in
    :meth:`usp.models.Levers.apply`). A preset: float32 on the CPU,
    initialised from ``[train] seed`` identically on every rank. A checkpoint in one
    process: loaded on the CPU. A checkpoint in a distributed run: built on the meta
    device (no memory), to be sharded first and filled by :func:`load_weights` (rank 0
    reads the files once and broadcasts, so a node holds one copy of the weights, not
    one per rank). ``[train] lora``: the base frozen and LoRA adapters added
    (:func:`usp.models.apply_lora`, seeded by ``[train] seed``), before the levers.
    With ``[train] compile`` each decoder layer is compiled (:func:`compile_layers`)."""
    family = family_of(source.config)
    levers = job.train.levers if levers is None else levers
    if source.directory is None:
        torch.manual_seed(job.train.seed)
        model = family.build(source.config, plan)
    elif plan.topology.single_process:
        model = family.from_pretrained(
            source.directory, plan, dtype=torch.float32, config=source.config,
            file_config=source.file_config,
        )  # fmt: skip
    else:
        with torch.device("meta"):
            model = family.build(source.config, plan)
    if job.train.lora is not None:
        try:
            apply_lora(model, job.train.lora, seed=job.train.seed)
        except LoraError as err:
            raise job.error(f"[train] lora: {err}") from None
    try:
        levers.apply(model, offloader=offloader)
    except LeverError as err:
        raise job.error(f"[train] {err}") from None
    if job.train.compile:  # [train] compile: each decoder layer, from outside the model
        compile_layers(model)
    return model


def load_weights(
    model, source: ModelSource, device: torch.device, levers: Levers, *, seed: int = 0
) -> None:
    """Fill a sharded model built on the meta device with the checkpoint's weights
    (float32 master weights; LoRA's frozen base in its own dtype) and LoRA's initial
    adapters: rank 0 reads the files, every rank receives its shards (on the host with
    ``levers.offload_parameters``). A collective; a
    checkpoint rank 0 cannot read fails on every rank alike."""
    model.to_empty(device=parameters_device(levers, device))  # the host with offload_parameters
    full, error = {}, None
    if dist.get_rank() == 0:
        try:
            loaded = family_of(source.config).from_pretrained(
                source.directory, None, dtype=torch.float32, file_config=source.file_config
            )
            full = loaded.state_dict()
            if lora_of(model) is not None:  # the adapters' start, as one process draws it
                full.update(initial_adapters(model, seed))
        except (CheckpointError, ModelConfigError, OSError) as err:
            error = CheckpointError(str(err))
    agree(dist.group.WORLD, f"loading {source.directory}", [], error, (CheckpointError,))
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)


def compute_dtype(job: TrainJobConfig, device: torch.device) -> torch.dtype:
    if job.train.dtype == AUTO:
        return default_compute_dtype(device)
    return TORCH_DTYPES[job.train.dtype]


def default_compute_dtype(device: torch.device) -> torch.dtype:
    """``dtype = "auto"``: bf16 on CUDA, float32 elsewhere."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_optimizer(
    job: TrainJobConfig, model: torch.nn.Module, levers: Levers
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (with LoRA: the adapters only); weight decay
    on matrices only (not on norms). With ``levers.offload_optimizer`` (the levers the
    model was built with) a :class:`usp.train.host_optimizer.HostAdamW`: the same
    update, its state and its step on the host (in place on host parameters with
    ``offload_parameters``)."""
    t = job.train
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    options = {"lr": t.lr, "betas": t.adam_betas, "eps": t.adam_eps}
    if levers.offload_optimizer:
        return HostAdamW(groups, params_on_host=levers.offload_parameters, **options)
    return torch.optim.AdamW(groups, **options)


def resolve_device(job: TrainJobConfig, plan) -> torch.device:
    """The plan's device for a distributed run; for one process, ``[train] device``."""
    if not plan.topology.single_process:
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
