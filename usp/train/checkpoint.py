"""Resumable training checkpoints (``torch.distributed.checkpoint``) and the final HF
export.

Layout of ``OUTPUT/checkpoints/step_000050/``: DCP's files (every rank writes its own
shards; multi-node runs need ``OUTPUT`` on a shared file system) and ``usp_meta.json``,
written by rank 0 after every rank has finished, which marks the checkpoint complete and
records the step, the world size, the model's shape and every file's size and checksum
(:mod:`usp.train.checkpoint_integrity`: hashed by the ranks that wrote them, verified
before a load; a damaged file fails the load naming it, and the resume falls back to
the previous checkpoint). What is saved: the model's trainable parameters (all of them,
or LoRA's adapters: frozen weights come from ``[model]`` again on resume) and AdamW
state through ``get_state_dict`` (sharded, so a checkpoint can be loaded onto another
number of ranks), the step (which is the whole schedule state), the data
loader's position and every rank's RNG states. Scalars are stored as tensors, so loading
unpickles nothing but DCP's own metadata -- still, load checkpoints only from a trusted
source.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from usp.errors import CheckpointError
from usp.models import family_of
from usp.models.lora import lora_of
from usp.models.lora_export import merged_state, save_peft_adapter
from usp.train.checkpoint_integrity import DcpLog, record_checksums, verify_checksums
from usp.train.checkpoint_shape import check_shape, model_shape

META_FILE = "usp_meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _state_options():
    """The trainable parameters only: frozen ones (LoRA's base weights) are rebuilt from
    ``[model]`` on resume, unchanged. Loading is not strict about the frozen keys the
    checkpoint lacks (``dcp.load`` still requires every trainable one)."""
    return StateDictOptions(ignore_frozen_params=True, strict=False)


@dataclass(frozen=True)
class SaveStats:
    """One save as rank 0 saw it: the checkpoint's bytes, the seconds of the whole save
    and of the checksums in it (the slowest rank's)."""

    path: Path
    bytes: int
    seconds: float
    checksum_seconds: float


@dataclass(frozen=True)
class TrainState:
    """What besides model and optimizer a resumed run needs."""

    step: int  # optimizer steps done (the schedule is a function of it)
    data_position: int  # the loader's next global sequence


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quietly():
    """DCP warns on every single-process save/load that it assumes one process: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class Checkpointer:
    """Save to and resume from ``directory`` (``OUTPUT/checkpoints``)."""

    def __init__(self, directory: Path, *, model_config, keep: int = 2, run: dict | None = None):
        self.directory = Path(directory)
        self.shape = model_shape(model_config)  # as usp_meta.json records it (JSON's form)
        self.keep = keep
        self.run = run  # what usp_meta.json records about the run (usp.train.resume)
        self.dcp_log = DcpLog(self.directory / "dcp.log")  # DCP's messages, off the console
        self.saves: list[SaveStats] = []  # this process's saves (sizes on rank 0 only)

    # -------------------------------------------------------------- discovery
    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as ``(step, path)``, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / META_FILE).is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def newest(self) -> Path | None:
        found = self.complete()
        return found[-1][1] if found else None

    # -------------------------------------------------------------- save
    def save(self, model, optimizer, state: TrainState) -> Path:
        """A collective: every rank must call it."""
        path = self.directory / f"step_{state.step:06d}"
        started = time.perf_counter()
        if _is_rank0() and path.is_dir() and not path.is_symlink():
            # an earlier checkpoint of this step that a resume fell back past (damaged) or
            # never completed: replaced whole, its completeness marker first
            (path / META_FILE).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options())
        try:
            with _single_process_quietly(), self.dcp_log:
                metadata = dcp.save(
                    self._payload(model_sd, optim_sd, state),
                    checkpoint_id=str(path),
                    no_dist=not dist.is_initialized(),
                )
        except CheckpointException as err:  # a BaseException: DCP raises it on every rank
            raise CheckpointError(self._save_failed(path, err)) from None
        # every rank's shards are on disk (the checksums' gather waits for all of them)
        # before the checkpoint counts as complete
        checksums, checksum_seconds = record_checksums(path, metadata)
        if _is_rank0():
            meta = {
                "step": state.step,
                "world_size": _world_size(),
                "model": self.shape,
                "checksums": checksums,
            }
            if self.run is not None:
                meta["run"] = self.run
            tmp = path / f".{META_FILE}.tmp"
            tmp.write_text(json.dumps(meta, indent=2) + "\n")
            os.replace(tmp, path / META_FILE)
            self._prune()
        _barrier()
        size = sum(f["bytes"] for f in checksums["files"].values()) if checksums else 0
        seconds = time.perf_counter() - started
        self.saves.append(SaveStats(path, size, seconds, checksum_seconds))
        return path

    def saves_note(self) -> str:
        """The slowest of this run's saves: what torchrun's --shutdown-timeout must cover
        (with one step), so a SIGTERM's checkpoint is written before the workers are
        killed (sizes as rank 0 knows them)."""
        slowest = max(self.saves, key=lambda s: s.seconds)
        return (
            f"checkpoints: {len(self.saves)} saved, the slowest {slowest.seconds:.1f} s for "
            f"{slowest.bytes / 1e6:,.1f} MB (checksums {slowest.checksum_seconds:.2f} s of "
            "it); torchrun's --shutdown-timeout must cover one step plus one save"
        )

    def _save_failed(self, path: Path, err: CheckpointException) -> str:
        """One message for a failed save, the same on every rank (DCP hands every rank
        the failures of all of them): which ranks failed, the first one's error, what
        to check, and which checkpoint a ``--resume`` would use."""
        failures = getattr(err, "failures", None) or {}
        ranks = sorted(failures)
        if ranks:
            first = failures[ranks[0]][0]
            why = f"rank(s) {', '.join(map(str, ranks))}: {type(first).__name__}: {first}"
        else:
            why = str(err).strip().splitlines()[0]
        newest = self.newest()
        kept = (
            f"the newest complete checkpoint is still {newest.name}"
            if newest is not None
            else "there is no complete checkpoint yet"
        )
        return (
            f"saving the checkpoint {path} failed ({why}); make sure the output directory "
            f"is writable from every rank, on storage they all share, with room for a "
            f"checkpoint; {kept} (--resume continues from it)"
        )

    def _payload(self, model_sd, optim_sd, state: TrainState) -> dict:
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "train": {
                "step": torch.tensor(state.step, dtype=torch.int64),
                "data_position": torch.tensor(state.data_position, dtype=torch.int64),
            },
            # one entry per rank (the keys differ, so DCP keeps every rank's)
            "rng": {f"rank{_rank()}": _rng_state()},
        }

    def _prune(self) -> None:
        """Delete all but the newest ``keep`` complete checkpoints. The completeness
        marker goes first, so a kill half-way leaves an incomplete (ignored) directory,
        never a "complete" one without its shards."""
        for _, old in self.complete()[: -self.keep]:
            (old / META_FILE).unlink(missing_ok=True)
            shutil.rmtree(old, ignore_errors=True)

    # -------------------------------------------------------------- load
    def read_meta(self, path: Path) -> dict:
        try:
            meta = json.loads((path / META_FILE).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(
                f"{path} is not a complete checkpoint ({META_FILE}: {err})"
            ) from None
        if not isinstance(meta, dict):
            raise CheckpointError(
                f"{path} is not a complete checkpoint ({META_FILE}: not an object)"
            )
        saved = meta.get("model", {})
        if not isinstance(saved, dict):
            raise CheckpointError(
                f"{path} is not a complete checkpoint ({META_FILE}: its model shape is not an "
                "object)"
            )
        saved = {"family": "llama", **saved}  # checkpoints of usp before the family registry
        check_shape(saved, self.shape, path=path)  # by value: JSON's lists are tuples here
        return meta

    def load(self, path: Path, model, optimizer) -> TrainState:
        """Load ``path`` into ``model`` and ``optimizer`` (a collective) and restore this
        rank's RNG when the world size matches the one that saved it."""
        meta = self.read_meta(path)
        verify_checksums(path, meta.get("checksums"))  # the same error on every rank
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options())
        state = TrainState(0, 0)
        payload = self._payload(model_sd, optim_sd, state)
        same_world = meta.get("world_size") == _world_size()
        if not same_world:
            del payload["rng"]  # another rank count: the saved per-rank states do not map
        with _single_process_quietly(), self.dcp_log:
            dcp.load(payload, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        set_state_dict(
            model,
            optimizer,
            model_state_dict=payload["model"],
            optim_state_dict=payload["optimizer"],
            options=_state_options(),
        )
        if same_world:
            rng = payload["rng"][f"rank{_rank()}"]
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        train = payload["train"]
        return TrainState(int(train["step"]), int(train["data_position"]))


def export_hf(
    model,
    model_config,
    directory: Path,
    *,
    dtype: torch.dtype | None = None,
    copy_from: Path | None = None,
    adapter_dir: Path | None = None,
) -> Path | None:
    """Gather the full weights and write an HF checkpoint (``config.json`` +
    ``model.safetensors``) into ``directory`` on rank 0 (a collective; returns the
    directory on rank 0, None elsewhere). ``dtype``: the weights' dtype in the files
    (default: the master weights'). Tokenizer files of ``copy_from`` (the source model
    directory) are copied along, so the export is a complete model directory. A model
    with LoRA adapters (:mod:`usp.models.lora`) is exported merged, and its adapters as
    a PEFT adapter into ``adapter_dir`` (when given)."""
    if dist.is_initialized():
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(model, options=options)
    else:
        full = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if not _is_rank0():
        return None
    lora = lora_of(model)
    if lora is not None:
        if adapter_dir is not None:
            save_peft_adapter(adapter_dir, full, lora, base_model=copy_from)
        full = merged_state(full, lora)
    if dtype is not None:
        full = {k: v.to(dtype) for k, v in full.items()}
    with torch.device("meta"):
        plain = family_of(model_config).build(model_config, None)
    plain.load_state_dict(full, strict=True, assign=True)
    out = plain.save_pretrained(directory)
    if copy_from is not None:
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
            "chat_template.jinja",
            "chat_template.json",
            "added_tokens.json",
            "tokenizer.model",
            "vocab.json",
            "merges.txt",
        ):
            if (copy_from / name).is_file():
                shutil.copy2(copy_from / name, out / name)
    return out
