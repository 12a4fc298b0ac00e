"""``usp eval TARGET --lengths 4096,16384 [--passkey] [--json]``: the long-context check
of a trained model, forward only, in one process or under torchrun (lengths beyond one
device: every rank holds the model, the sequence is split over ulysses x ring).

    torchrun --nproc-per-node 4 -m usp eval runs/cpu_finetune --config examples/configs/cpu_finetune.toml --lengths 256,1024 --passkey
    usp eval runs/cpu_finetune --config examples/configs/cpu_finetune.toml --lengths 256,1024 --nproc-per-node 4

This module is the command each process runs. The flags are parsed by :mod:`usp.cli.eval`
(no torch), which in the second form runs ``usp train``'s launcher (:mod:`usp.cli.launch`):
the workers are started without this module loaded in the launcher, and the first failing
rank's error is the last line printed.

Set-up (resolving TARGET, the tokenizer, the held-out data, the lengths, the weights)
runs on every rank and ends in an agreement, so an error on one rank is the same error
on every rank (exit status 2, printed once per node). Rank 0 writes ``eval.json`` (and
the plots) into ``--output`` (default ``TARGET/eval`` for a training output, ``TARGET-eval``
beside an HF directory) and prints the table, or the JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from usp.comm.agreement import agree
from usp.config import AUTO, ConfigError, config_from_dict
from usp.config.launch import GridSizeError
from usp.evaluation.report import table, to_json, write_plots
from usp.evaluation.runner import DEFAULT_DEPTHS, EvalSettings, check_settings, run_checks
from usp.evaluation.target import eval_tokenizer, held_out_stream, load_model, resolve_target
from usp.models import family_of
from usp.process_groups import SINGLE_PROCESS
from usp.sp.plan import Plan
from usp.train.cli import _init_process_group, _teardown  # usp train's, shared
from usp.train.components import TORCH_DTYPES, default_compute_dtype
from usp.train.config import load_train_config
from usp.train.error_file import FINISHED, write_error_file
from usp.train.setup import user_errors as user_error_kinds

EXIT_DONE, EXIT_INTERNAL, EXIT_USER = 0, 1, 2


def run(args: argparse.Namespace) -> int:
    """The ``usp eval`` command; returns the exit status. Under a launcher each rank
    records its error, or that it finished, for the launcher's last line."""
    try:
        settings, job, device = prepare(args)
    except ConfigError as err:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(f"usp eval: error: {err}", file=sys.stderr)
        write_error_file(f"usp eval: error: {err}", EXIT_USER)
        return EXIT_USER
    user_errors = user_error_kinds()
    topology, synchronised = SINGLE_PROCESS, True
    try:
        timeout = job.train.collective_timeout_s if job is not None else 600.0
        _init_process_group(device, timeout)
        report, plan = evaluate_target(args, job, settings, user_errors)
        topology = plan.topology
        if topology.rank == 0:
            _write(report, args)
        rank = os.environ.get("RANK", 0)
        write_error_file(f"usp eval [rank {rank}]: the evaluation finished", FINISHED)
        return EXIT_DONE
    except KeyboardInterrupt:
        synchronised = False
        raise
    except Exception as err:  # noqa: BLE001 - report, then exit with a status
        synchronised = isinstance(err, user_errors)
        prefix = f"usp eval [rank {os.environ.get('RANK', 0)}]: error: "
        if not synchronised or int(os.environ.get("LOCAL_RANK", 0)) == 0:
            text = str(err) if synchronised else "".join(traceback.format_exception(err))
            if isinstance(err, GridSizeError):
                text = err.with_fixes("torchrun --nproc-per-node {ranks} -m usp eval ...")
            print(prefix + text, file=sys.stderr, flush=True)
        status = EXIT_USER if synchronised else EXIT_INTERNAL
        write_error_file(prefix + str(err), status)
        return status
    finally:
        if synchronised:
            _teardown(topology)


def prepare(args: argparse.Namespace):
    """``(settings, job, device type)`` from the flags (no process group yet); a
    :class:`ConfigError` for a bad flag or config."""
    settings = EvalSettings(
        tuple(args.lengths),
        buckets=args.buckets,
        windows=args.windows,
        passkey=args.passkey,
        depths=DEFAULT_DEPTHS if args.depths is None else tuple(args.depths),
        trials=args.trials,
        seed=args.seed,
    )
    job = _job(args)
    return settings, job, _device(args, job)


def _job(args):
    if args.config is None:
        return None
    return load_train_config(
        args.config, ulysses=args.ulysses, ring=args.ring, dp=args.dp, device=args.device
    )


def _device(args, job) -> str:
    wanted = args.device or (job.train.device if job is not None else AUTO)
    if wanted == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "the device is cuda (--device or [train] device) but CUDA is not available"
        )
    return wanted


def evaluate_target(args, job, settings: EvalSettings, user_errors):
    """Every rank: resolve, agree, build the plan, load, agree, run the checks. Returns
    ``(report, plan)``; the report is the same on every rank."""
    error, target = None, None
    try:
        target = resolve_target(args.target, job)
    except user_errors as err:
        error = err
    agree(dist.group.WORLD, "usp eval: reading TARGET", [], error, user_errors)
    c = target.config
    topology_config = _topology_config(args, job).with_heads(
        c.num_attention_heads, c.num_key_value_heads, c.attention_head_dim
    )
    plan = Plan.from_config(topology_config, topology="build", verify_calls=False)
    try:
        return _evaluate_on_plan(args, job, settings, user_errors, target, plan)
    except user_errors:
        plan.topology.destroy()  # raised on every rank alike: they can tear down together
        raise


def _evaluate_on_plan(args, job, settings, user_errors, target, plan):
    error, loaded = None, None
    try:
        out = output_dir(args, target)
        if plan.topology.rank == 0:
            _make_output_dir(out)
        tokenizer = eval_tokenizer(target, job, args.tokenizer)
        stream, target_flags, data = held_out_stream(tokenizer, data=args.data, job=job)
        notes = check_settings(settings, plan, tokenizer, stream.numel())
        device = plan.default_device()
        dtype = default_compute_dtype(device) if args.dtype == AUTO else TORCH_DTYPES[args.dtype]
        refusal = family_of(target.config).kernel_refusal(target.config, plan, device, dtype)
        if refusal is not None:  # a GDN kernel [attention] forces that cannot run here
            raise ConfigError(f"[attention] {refusal}")
        model = load_model(target, plan, device, dtype)
        loaded = model, tokenizer, stream, target_flags, data, notes
    except user_errors as err:
        error = err
    agree(dist.group.WORLD, "usp eval set-up", [], error, user_errors)
    model, tokenizer, stream, target_flags, data, notes = loaded
    results = run_checks(model, plan, stream, target_flags, tokenizer, settings)
    report = {
        "target": target.describe(),
        "plan": plan.describe(),
        "ranks": plan.topology.world_size,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "data": f"{data}, {stream.numel()} tokens ({int(target_flags.sum())} carry a loss)",
        "output": str(out),
        "lengths": list(settings.lengths),
        "buckets": settings.buckets,
        **results,
        "notes": notes,
    }
    if settings.passkey:
        report["passkey_depths"] = list(settings.depths)
        report["passkey_trials"] = settings.trials
        report["passkey_seed"] = settings.seed
    return report, plan


def _topology_config(args, job):
    if job is not None:
        return job.topology  # with the --ulysses/--ring/--dp overrides already applied
    parallel = {
        "ulysses": args.ulysses or AUTO,
        "ring": args.ring or AUTO,
        "dp": args.dp or 1,
    }
    return config_from_dict(
        {"cluster": {"nodes": AUTO, "gpus_per_node": AUTO}, "parallel": parallel}
    )


def output_dir(args, target) -> Path:
    """``--output``, else ``eval/`` in the training output directory (``eval/step_N``
    for one checkpoint), and for an HF directory ``DIR-eval`` beside it: a model
    directory stays what it was (it may be copied, uploaded or loaded as it is)."""
    if args.output:
        return Path(args.output)
    if target.checkpoint is not None and target.path == target.checkpoint:  # a step_N
        return target.checkpoint.parent.parent / "eval" / target.checkpoint.name
    if target.hf_dir is not None:
        return target.path.parent / f"{target.path.name}-eval"
    return target.path / "eval"


def _make_output_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".usp-eval-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"the output directory {out} is not writable ({err}); choose another with --output"
        ) from None


def _write(report: dict, args) -> None:
    out = Path(report["output"])
    report["files"] = {"eval.json": str(out / "eval.json"), **write_plots(report, out)}
    (out / "eval.json").write_text(to_json(report))
    if args.json:
        sys.stdout.write(to_json(report))
    else:
        print(table(report))
    sys.stdout.flush()
