"""HF-format checkpoints: ``config.json`` + safetensors, read from and written to local
directories only (no hub access, no pickles: safetensors runs no code on load).

Loading builds the model on the meta device and places each tensor into it as it is
read (cast to the requested dtype on the way), so a model never exists twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from usp.errors import CheckpointError  # noqa: F401 - re-exported here
from usp.models.config import DecoderConfig, ModelConfigError
from usp.models.moe_keys import (
    expert_key,
    join_expert_tensors,
    per_expert_names,
    split_expert_tensors,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: checkpoint keys that hold no parameter of this model (old HF exports carry them)
_IGNORED_KEYS = ("rotary_emb.inv_freq",)


def _safetensors():
    try:
        import safetensors.torch  # noqa: F401 - the submodule is what we use
        from safetensors import safe_open
    except ImportError:
        raise ImportError(
            "reading and writing HF checkpoints needs the safetensors package: "
            "pip install safetensors (or usp[hf])"
        ) from None
    return safe_open, safetensors.torch


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a resolved directory holding ``config.json``, or a clear error."""
    directory = Path(path).expanduser().resolve()
    if not directory.exists():
        raise CheckpointError(
            f"checkpoint directory {directory} does not exist (from_pretrained reads local "
            "HF-format directories only; it never downloads)"
        )
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory: give the checkpoint's directory")
    if not (directory / CONFIG_FILE).is_file():
        present = sorted(p.name for p in directory.iterdir())[:8]
        raise CheckpointError(
            f"no {CONFIG_FILE} in {directory}: an HF-format checkpoint directory holds "
            f"{CONFIG_FILE} and {WEIGHTS_FILE} (or {INDEX_FILE} + shards); "
            f"found: {', '.join(present) or 'nothing'}"
        )
    return directory


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the single file, or the shards its index
    names (each checked to exist)."""
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        return [single]
    if not index.is_file():
        raise CheckpointError(
            f"no {WEIGHTS_FILE} or {INDEX_FILE} in {directory} (only safetensors "
            "checkpoints are read; convert .bin/.pt files with transformers first)"
        )
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index} has no valid 'weight_map': {err}") from None
    shards = []
    for name in dict.fromkeys(weight_map.values()):  # unique, in order
        shard = (directory / name).resolve()
        if shard.parent != directory or not shard.is_file():
            raise CheckpointError(
                f"{index} names shard {name!r}, which is not a file in {directory}"
            )
        shards.append(shard)
    return shards


def _config_dtype(config: DecoderConfig) -> torch.dtype | None:
    name = config.extra.get("torch_dtype") or config.extra.get("dtype")
    value = getattr(torch, name, None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def _few(names, limit: int = 5) -> str:
    names = sorted(names)
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_pretrained(
    cls, path, plan=None, /, *, dtype=None, device=None, config=None, file_config=None, **kwargs
):
    """``cls.from_pretrained`` (``cls`` a family's model class): see
    :meth:`usp.models.decoder.CausalLM.from_pretrained`. ``file_config``: the
    directory's ``config.json`` as its caller read it already (``usp train`` reads it
    once per rank); None reads it here."""
    safe_open, _ = _safetensors()
    directory = checkpoint_dir(path)
    if file_config is None:
        file_config = cls.config_class.from_json_file(directory / CONFIG_FILE)
    if config is None:
        config = file_config
    else:  # new position settings only (context extension); the architecture is the file's
        try:
            file_config.position_changes(config)
        except ModelConfigError as err:
            raise ModelConfigError(f"{directory / CONFIG_FILE}: {err}") from None
    files = weight_files(directory)
    device = torch.device("cpu" if device is None else device)
    dtype = dtype or _config_dtype(config)
    with torch.device("meta"):
        model = cls(config, plan, **kwargs)
    expected = dict(model.named_parameters())
    per_expert = per_expert_names(model)
    state, unexpected, wrong_shape = {}, [], []
    experts: dict = {}  # per-expert tensors of grouped parameters (usp.models.moe)
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as reader:
            for stored in reader.keys():  # noqa: SIM118 - safe_open is not a mapping
                key = cls.checkpoint_key(stored)  # a family's other layouts (None: not ours)
                if key is None:
                    continue
                grouped = expert_key(key) if key not in expected else None
                if grouped is not None and grouped[0] in per_expert:
                    name, expert, projection = grouped
                    piece = reader.get_tensor(stored)
                    dtype = dtype or piece.dtype
                    experts.setdefault(name, {}).setdefault(expert, {})[projection] = piece.to(
                        dtype
                    )
                    continue
                if key not in expected:
                    unexpected.append(key)
                    continue
                tensor = reader.get_tensor(stored)
                if tuple(tensor.shape) != tuple(expected[key].shape):
                    wrong_shape.append(
                        f"{key}: {tuple(tensor.shape)} (config wants {tuple(expected[key].shape)})"
                    )
                    continue
                dtype = dtype or tensor.dtype  # no dtype asked or in config: the first tensor's
                state[key] = tensor.to(dtype)
    joined, misshapen = join_expert_tensors(experts, expected)
    state.update(joined)
    wrong_shape.extend(misshapen)
    unexpected = [
        k
        for k in unexpected
        if not k.endswith(_IGNORED_KEYS)
        # tied checkpoints sometimes store the output projection too; it equals the embedding
        and not (config.tie_word_embeddings and k == "lm_head.weight")
    ]
    missing = [k for k in expected if k not in state]
    problems = []
    if wrong_shape:
        problems.append(f"shapes differ from {CONFIG_FILE}: {_few(wrong_shape, 3)}")
    if missing:
        problems.append(f"{len(missing)} parameter(s) missing: {_few(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s): {_few(unexpected)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {directory} does not match a {file_config.family} model with its "
            f"{CONFIG_FILE}: " + "; ".join(problems)
        )
    model.load_state_dict(state, strict=True, assign=True)
    return model


def save_pretrained(model, path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` into ``path`` (created if needed)."""
    _, st = _safetensors()
    directory = Path(path).expanduser().resolve()
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{directory} exists and is not a directory")
    if (directory / INDEX_FILE).exists():
        raise CheckpointError(
            f"{directory} holds a sharded checkpoint ({INDEX_FILE}); save into another "
            "directory so the two cannot be mixed up"
        )
    state, per_expert = {}, per_expert_names(model)
    for name, param in model.named_parameters():  # tied weights appear once
        if isinstance(param, DTensor) or param.device.type == "meta":
            where = "on the meta device" if param.device.type == "meta" else "sharded (a DTensor)"
            raise CheckpointError(
                f"parameter {name} is {where}; save_pretrained needs full local tensors "
                "(gather a sharded model's state dict first)"
            )
        # grouped expert weights go out as transformers reads them: one tensor per expert
        tensor = param.detach().to("cpu").contiguous()
        state.update(split_expert_tensors(name, tensor) if name in per_expert else {name: tensor})
    dtypes = {t.dtype for t in state.values()}
    dtype = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else None
    directory.mkdir(parents=True, exist_ok=True)
    _write_atomic(
        directory / CONFIG_FILE,
        lambda tmp: tmp.write_text(
            json.dumps(model.config.to_hf_dict(dtype=dtype), indent=2) + "\n"
        ),
    )
    _write_atomic(
        directory / WEIGHTS_FILE,
        lambda tmp: st.save_file(state, str(tmp), metadata={"format": "pt"}),
    )
    return directory


def _write_atomic(target: Path, write) -> None:
    """Write next to ``target``, then rename: a crash never leaves a half-written file."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


__all__ = [
    "CheckpointError",
    "ModelConfigError",
    "checkpoint_dir",
    "load_pretrained",
    "save_pretrained",
]
