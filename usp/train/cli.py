"""``usp train CONFIG``: the training command (launched by torchrun, one process per
device).

    torchrun --nproc-per-node 4 -m usp train examples/configs/cpu_finetune.toml

Flags override the file (``--steps``, ``--output``, ``--ulysses/--ring/--dp``,
``--device``, and ``--set SECTION.KEY=VALUE`` for any field); ``--resume`` continues from
the newest checkpoint in the output directory. Under torchrun each failing rank also
leaves its error line for the launcher (:mod:`usp.train.error_file`), and a rank whose
run finished says so before it tears down (should it die at exit, the launcher reports a
finished run). Without torchrun's environment a single process runs (a world of 1). The
process group is set up here, the topology built from the config (its shape checked
against the launch), and everything is torn down through
:func:`usp.process_groups.shutdown.shutdown` at the end (threads quiet, the topology's
groups, then the default group), also after an error that every rank shares.
Exit status (``usp.train.guard.EXIT_STATUS``): 0 done; 2 a config, data or checkpoint
error or an output directory in use (printed once per node); 3 the run diverged
(non-finite loss, gradient norm or weights); 4 a collective failed or timed out (a peer
stalled or died); 5 stopped by SIGTERM/SIGINT after saving a checkpoint; 128+N a second
signal N, exited at once; 1 anything else (with its traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from usp.config import AUTO, ConfigError
from usp.config.allocator import set_allocator_default
from usp.config.launch import GridSizeError
from usp.process_groups import SINGLE_PROCESS
from usp.process_groups.shutdown import shutdown
from usp.train.components import build_plan, model_source  # a job's Plan, its model
from usp.train.config import load_train_config
from usp.train.error_file import FINISHED, write_error_file
from usp.train.guard import EXIT_STATUS, CollectiveFailedError, TrainingDivergedError
from usp.train.setup import user_errors as user_error_kinds
from usp.train.trainer import train

RENDEZVOUS_TIMEOUT_S = 600.0


def _launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _init_process_group(device: str, timeout_s: float) -> None:
    """torchrun's env:// rendezvous, or a world of one process without torchrun. The
    rendezvous waits up to ``max(timeout_s, RENDEZVOUS_TIMEOUT_S)`` for every rank to start
    (imports take long on a loaded machine); after it, every collective waits at most
    ``timeout_s`` for a peer (the topology's groups inherit the default group's)."""
    if device == "cuda":
        set_allocator_default()  # expandable_segments, before CUDA's allocator starts
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        # share the machine's cores among the processes on it
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S))
    if _launched_by_torchrun():
        dist.init_process_group(backend, timeout=timeout)
    else:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    dist.group.WORLD.set_timeout(timedelta(seconds=timeout_s))


def _device_of(job, flag: str | None) -> str:
    wanted = flag or job.train.device
    if wanted == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise job.error(
            "the device is cuda ([train] device or --device) but CUDA is not available; "
            "use --device cpu"
        )
    return wanted


def _should_print(error: BaseException, user_errors) -> bool:
    """User errors are the same on every rank: print them once per node (a missing file
    may be missing on one node only). Anything else: every rank says what happened."""
    if not isinstance(error, user_errors):
        return True
    return int(os.environ.get("LOCAL_RANK", 0)) == 0


def run(args: argparse.Namespace) -> int:
    """The ``usp train`` command; returns the exit status."""
    try:
        job = load_train_config(
            args.config,
            sets=getattr(args, "sets", None) or (),
            steps=args.steps,
            output_dir=args.output,
            ulysses=args.ulysses,
            ring=args.ring,
            dp=args.dp,
            device=args.device,
        )
    except ConfigError as err:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"usp train: error: {err}", file=sys.stderr)
        write_error_file(f"usp train: error: {err}", 2)
        return 2
    user_errors = user_error_kinds()
    topology, synchronised = SINGLE_PROCESS, True
    try:
        _init_process_group(_device_of(job, args.device), job.train.collective_timeout_s)
        source = model_source(job)  # config.json, read once for the plan and the run
        plan = build_plan(job, source=source)
        topology = plan.topology
        result = _train(job, plan, source, args.resume, getattr(args, "resume_changed", False))
        if result.stopped_by is not None:
            line = (
                f"usp train: stopped by {result.stopped_by} at step {result.stopped_at}; "
                f"checkpoint {result.checkpoint.name}; --resume continues"
            )
            if topology.rank == 0:
                print(line, file=sys.stderr, flush=True)
            write_error_file(line, EXIT_STATUS["signal"])
            return EXIT_STATUS["signal"]
        if topology.rank == 0:
            print(summary(result), flush=True)
        # for the launcher, should this rank die after this (in the teardown, at exit)
        write_error_file(finished_line(result, os.environ.get("RANK", 0)), FINISHED)
        return EXIT_STATUS["done"]
    except CollectiveFailedError as err:
        # a peer is stalled or gone: leave at once, without waiting for it (not even in
        # the process group's destructor at interpreter exit, which can wait for it again)
        line = f"usp train [rank {os.environ.get('RANK', 0)}]: error: {err}"
        print(line, file=sys.stderr)
        write_error_file(line, EXIT_STATUS["collective"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STATUS["collective"])
    except KeyboardInterrupt:
        synchronised = False  # peers may be anywhere: leave without waiting for them
        raise
    except Exception as err:  # noqa: BLE001 - report, then exit with a status
        # a user error is raised on every rank alike (the set-up agrees on it), so the
        # ranks can still tear down together; after anything else a peer may be stuck in
        # a collective, and only exiting lets torchrun stop the job
        synchronised = isinstance(err, user_errors)
        prefix = f"usp train [rank {os.environ.get('RANK', 0)}]: error: "
        what = str(err) if isinstance(err, user_errors) else f"{type(err).__name__}: {err}"
        if isinstance(err, GridSizeError):  # the flags of this command that fix it
            what = err.with_fixes(f"usp train {args.config} --nproc-per-node {{ranks}}")
        if _should_print(err, user_errors):
            if isinstance(err, user_errors):
                print(prefix + what, file=sys.stderr, flush=True)
            else:
                print(
                    prefix + "".join(traceback.format_exception(err)), file=sys.stderr, flush=True
                )
        if isinstance(err, TrainingDivergedError):
            status = EXIT_STATUS["diverged"]
        else:
            status = (
                EXIT_STATUS["user"] if isinstance(err, user_errors) else EXIT_STATUS["internal"]
            )
        write_error_file(prefix + what, status)
        return status
    finally:
        if synchronised:
            _teardown(topology)


def _train(job, plan, source, resume: bool, resume_changed: bool = False):
    return train(job, plan, resume=resume, resume_changed=resume_changed, source=source)


def _teardown(topology) -> None:
    """Every process group destroyed (``Topology.destroy()`` synchronises the ranks), then
    the default one, and their threads joined before the interpreter shuts down
    (:func:`usp.process_groups.shutdown.shutdown`: a rank must not abort at exit)."""
    shutdown(topology)


def finished_line(result, rank) -> str:
    """What a rank records once its run is done (the launcher's line if it then dies)."""
    rows = result.metrics
    steps = f"steps {result.start_step + 1}-{rows[-1]['step']}" if rows else "no steps to do"
    where = f"; checkpoint {result.checkpoint.name}" if result.checkpoint else ""
    return f"usp train [rank {rank}]: the run finished ({steps}{where})"


def summary(result) -> str:
    """The closing lines: what happened and where everything is."""
    rows = result.metrics
    lines = []
    if rows:
        seconds = sum(r["step_time_s"] for r in rows)
        lines.append(
            f"done: steps {result.start_step + 1}-{rows[-1]['step']} in {seconds:.0f} s, "
            f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}"
        )
    else:
        lines.append("done: nothing to do (the checkpoint is at the last step)")
    out = result.output_dir
    lines.append(f"  metrics:    {out / 'metrics.jsonl'}")
    lines.append(f"  loss plot:  {result.plot}" if result.plot else "  loss plot:  -")
    if result.checkpoint:
        lines.append(
            f"  checkpoint: {result.checkpoint} (--resume continues; with --steps N, further)"
        )
    if result.export_dir:
        lines.append(
            f"  HF export:  {result.export_dir} (usp.models.from_pretrained, transformers)"
        )
    lines += [f"  note: {n}" for n in result.notes]
    return "\n".join(lines)
