"""Training configs: the shipped files, every key's checks, overrides, and the command
line's errors before anything is launched (single process, no process group)."""

from __future__ import annotations

import io
from contextlib import redirect_stderr
from pathlib import Path
from types import SimpleNamespace

import pytest

from usp.cli import build_parser
from usp.config import ConfigError
from usp.train.components import check_lengths, model_source, topology_config
from usp.train.config import (
    is_train_config,
    load_train_config,
    train_config_from_dict,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"

MINIMAL = """
[cluster]
nodes = 1
gpus_per_node = 4

[parallel]
ulysses = 2
ring = 2

[model]
preset = "tiny"

[data]
source = "synthetic"

[train]
steps = 10
global_batch = 4
seq_len = 64
"""


def write(tmp_path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def with_line(section: str, line: str) -> str:
    """MINIMAL with ``line`` in ``[section]``: replacing the key's line, added to the
    section, or in a new section."""
    key = line.split("=")[0].strip()
    lines = MINIMAL.splitlines()
    start = lines.index(f"[{section}]") if f"[{section}]" in lines else None
    if start is not None:
        for i in range(start + 1, len(lines)):
            if lines[i].startswith("["):
                break
            if lines[i].split("=")[0].strip() == key:
                return "\n".join(lines[:i] + [line] + lines[i + 1 :]) + "\n"
    if start is not None:
        return MINIMAL.replace(f"[{section}]\n", f"[{section}]\n{line}\n", 1)
    return MINIMAL + f"\n[{section}]\n{line}\n"


# ----------------------------------------------------------------------------- shipped files
@pytest.mark.parametrize(
    "name, launch, world, degrees",
    [
        # the main job takes its processes per node from the launch ("auto"): here 4
        ("cpu_finetune.toml", {"gpus_per_node": 4}, 4, (2, 2, 1)),
        ("llama3_8b_128k.toml", {}, 16, (8, 2, 1)),
    ],
)
def test_shipped_training_configs_parse_and_resolve(name, launch, world, degrees):
    job = load_train_config(CONFIGS / name)
    resolved = job.topology.with_overrides(**launch).resolve()
    assert resolved.world_size == world
    assert (resolved.ulysses, resolved.ring, resolved.dp) == degrees
    assert job.train.seq_len % (resolved.ring * 2 * resolved.ulysses) == 0


def test_cpu_finetune_is_the_main_job():
    job = load_train_config(CONFIGS / "cpu_finetune.toml")
    assert job.model.preset == "tiny" and job.data.source == "synthetic"
    assert job.output_dir == Path("runs") / "cpu_finetune"
    assert job.gradient_accumulation(1) == job.train.global_batch // job.train.micro_batch


def test_topology_view_of_a_training_config_has_the_model_heads():
    config = topology_config(load_train_config(CONFIGS / "cpu_finetune.toml"))
    assert (config.model.num_heads, config.model.num_kv_heads) == (4, 2)
    assert is_train_config({"train": {}}) and not is_train_config({"cluster": {}})


# ----------------------------------------------------------------------------- errors
BAD = [
    ("train", "stepz = 3", "[train] unknown key 'stepz'"),
    ("train", 'lr = "fast"', '[train] lr must be a number > 0, got "fast"'),
    ("train", "micro_batch = 0", "[train] micro_batch must be an integer >= 1, got 0"),
    (
        "train",
        "activation_checkpointing = 1",
        '[train] activation_checkpointing must be true, false or "offload" (each layer\'s input '
        "kept in host memory), got 1",
    ),
    (
        "train",
        'activation_checkpointing = "cpu"',
        '[train] activation_checkpointing must be true, false or "offload" (each layer\'s input '
        'kept in host memory), got "cpu"',
    ),
    (
        "train",
        "mlp_tile_tokens = -4",
        "[train] mlp_tile_tokens must be an integer >= 0 (0: untiled; N: tiles of N local "
        "tokens), got -4",
    ),
    ("train", "mlp_tile_tokens = 1.5", "[train] mlp_tile_tokens must be an integer >= 0"),
    (
        "train",
        "attention_head_chunks = 0",
        "[train] attention_head_chunks must be an integer >= 1, got 0",
    ),
    ("train", 'dtype = "fp8"', '[train] dtype must be one of "auto", "float32", "bfloat16"'),
    ("train", "adam_betas = [0.9]", "[train] adam_betas must be two numbers in [0, 1)"),
    ("train", "min_lr_ratio = 2", "[train] min_lr_ratio must be a number in [0, 1], got 2"),
    ("train", "warmup_steps = -1", "[train] warmup_steps must be an integer >= 0, got -1"),
    ("train", 'device = "tpu"', '[train] device must be one of "auto", "cpu", "cuda"'),
    ("train", "peak_tflops = -1", "[train] peak_tflops must be a number > 0"),
    ("data", 'source = "hub"', '[data] source must be one of "jsonl", "synthetic"'),
    ("data", "files = [1]", "[data] files must be a path or a list of paths"),
    ("data", "document_multiple = 0", '[data] document_multiple must be an integer >= 1 or "auto"'),
    ("data", 'shuffle = "yes"', "[data] shuffle must be true or false"),
    (
        "data",
        'long_documents = "cut"',
        '[data] long_documents must be one of "truncate", "split", "drop", "error", got "cut"',
    ),
    ("model", 'path = "x"', "[model] needs exactly one of path"),
    ("model", "rope_theta = 0", "[model] rope_theta must be a number > 0, got 0"),
    ("model", "rope_scaling = 8.0", "[model] rope_scaling must be a table with a rope_type"),
    ("model", "rope_scaling = {factor = 8.0}", "[model] rope_scaling must be a table with a"),
    ("model", "max_position_embeddings = 0", "[model] max_position_embeddings must be an integer"),
    ("optimizer", "lr = 1", "unknown section [optimizer]"),
]


@pytest.mark.parametrize("section, line, message", BAD)
def test_bad_values_name_the_file_and_key(tmp_path, section, line, message):
    path = write(tmp_path, with_line(section, line))
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    assert str(info.value).startswith(f"{path}: "), info.value
    assert message in str(info.value), info.value


def test_missing_sections_and_keys(tmp_path):
    no_data = MINIMAL.replace('[data]\nsource = "synthetic"\n', "")
    with pytest.raises(ConfigError, match=r"missing section \[data\]"):
        load_train_config(write(tmp_path, no_data))
    no_steps = MINIMAL.replace("steps = 10\n", "")
    with pytest.raises(ConfigError, match=r"\[train\] missing required key 'steps'"):
        load_train_config(write(tmp_path, no_steps))
    jsonl_without_files = MINIMAL.replace('source = "synthetic"', 'source = "jsonl"')
    with pytest.raises(ConfigError, match=r"\[data\] files is required"):
        load_train_config(write(tmp_path, jsonl_without_files))
    with pytest.raises(ConfigError, match="no such config file"):
        load_train_config(tmp_path / "absent.toml")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_train_config(write(tmp_path, "[train\n"))
    bad_topology = MINIMAL.replace("ulysses = 2", "ulysses = 0")
    with pytest.raises(ConfigError, match=r"\[parallel\] ulysses"):
        load_train_config(write(tmp_path, bad_topology))


def test_overrides_replace_file_values(tmp_path):
    path = write(tmp_path, MINIMAL)
    job = load_train_config(
        path, steps=3, output_dir="elsewhere", ulysses=4, ring=1, dp=None, device="cpu"
    )
    assert job.train.steps == 3 and job.output_dir == Path("elsewhere")
    assert (job.topology.parallel.ulysses, job.topology.parallel.ring) == (4, 1)
    assert job.train.device == "cpu"
    with pytest.raises(ConfigError, match=r"\[train\] steps must be an integer >= 1"):
        load_train_config(path, steps=0)


def test_batch_arithmetic(tmp_path):
    job = load_train_config(write(tmp_path, with_line("train", "micro_batch = 2")))
    assert job.gradient_accumulation(dp=2) == 1
    with pytest.raises(ConfigError, match=r"global_batch\(4\) is not a multiple of dp\(3\)"):
        job.gradient_accumulation(dp=3)
    fixed = load_train_config(write(tmp_path, with_line("train", "gradient_accumulation = 3")))
    with pytest.raises(ConfigError, match=r"gradient_accumulation\(3\) = 3 != global_batch\(4\)"):
        fixed.gradient_accumulation(dp=1)


def test_position_settings_for_presets_and_checkpoints(tmp_path):
    from usp.models import PRESETS

    text = MINIMAL.replace(
        'preset = "tiny"',
        'preset = "tiny"\nrope_theta = 1e6\nmax_position_embeddings = 131072\n'
        'rope_scaling = {rope_type = "yarn", factor = 2.0}',
    )
    source = model_source(load_train_config(write(tmp_path, text)))
    assert source.config.rope_theta == 1e6 and source.config.max_position_embeddings == 131072
    original = PRESETS["tiny"].max_position_embeddings  # yarn measured against the preset's
    assert source.config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": original,
    }
    assert source.changes[0] == "rope_theta: 10000.0 -> 1000000.0"
    assert len(source.changes) == 3
    assert model_source(load_train_config(write(tmp_path, MINIMAL))).changes == ()
    twice = with_line("model.overrides", "rope_theta = 2e6").replace(
        'preset = "tiny"', 'preset = "tiny"\nrope_theta = 1e6'
    )
    with pytest.raises(ConfigError, match="rope_theta is given twice"):
        load_train_config(write(tmp_path, twice))
    unknown = MINIMAL.replace(
        'preset = "tiny"', 'preset = "tiny"\nrope_scaling = {rope_type = "dynamic", factor = 2.0}'
    )
    path = write(tmp_path, unknown)
    with pytest.raises(ConfigError) as err:
        model_source(load_train_config(path))
    assert str(err.value).startswith(f"{path}: [model] rope_scaling rope_type 'dynamic' is not "
                                     "supported; supported: default, linear, llama3, yarn")  # fmt: skip


def test_memory_levers_reach_the_model(tmp_path):
    from usp.models import Levers, levers_of
    from usp.sp.plan import Plan
    from usp.train.components import build_model

    text = with_line("train", 'activation_checkpointing = "offload"')
    job = load_train_config(
        write(
            tmp_path,
            text.replace("[train]\n", "[train]\nmlp_tile_tokens = 96\nattention_head_chunks = 2\n"),
        )
    )
    assert (job.train.activation_checkpointing, job.train.mlp_tile_tokens) == ("offload", 96)
    assert job.train.levers == Levers("offload", 96, 2)  # validated once, held by [train]
    model = build_model(job, model_source(job), Plan(None))
    assert levers_of(model) == Levers("offload", 96, 2)
    assert all(layer.mlp.forward.tile == 96 for layer in model.model.layers)
    assert all(layer.self_attn.head_chunks == 2 for layer in model.model.layers)
    # a head count the plan's ring cannot split: the [train] key in the message
    three = load_train_config(write(tmp_path, with_line("train", "attention_head_chunks = 3")))
    with pytest.raises(ConfigError, match=r"\[train\] attention_head_chunks must divide the 2"):
        build_model(three, model_source(three), Plan(None))
    plain = load_train_config(write(tmp_path, MINIMAL))
    assert (plain.train.activation_checkpointing, plain.train.mlp_tile_tokens) == (False, 0)
    assert plain.train.attention_head_chunks == 1
    assert plain.train.levers == Levers()


def test_the_start_up_header_shows_the_levers_the_model_was_built_with(tmp_path):
    from usp.train.trainer import train

    levers = '[train]\nactivation_checkpointing = "offload"\nmlp_tile_tokens = 96\n'
    job = load_train_config(write(tmp_path, MINIMAL.replace("[train]\n", levers)))
    stream = io.StringIO()
    train(job, None, output_dir=tmp_path / "out", stop_after=1, stream=stream)
    header = stream.getvalue()
    assert "\n  levers: checkpointing offload, MLP tiles 96, loss chunks 1024\n" in header, header


def test_model_section_errors(tmp_path):
    unknown = load_train_config(write(tmp_path, MINIMAL.replace('"tiny"', '"huge"')))
    with pytest.raises(
        ConfigError, match=r"\[model\] preset 'huge' is unknown; known presets: tiny"
    ):
        model_source(unknown)
    field = load_train_config(write(tmp_path, with_line("model.overrides", "depth = 3")))
    with pytest.raises(ConfigError, match=r"\[model.overrides\].*depth"):
        model_source(field)
    smaller = load_train_config(
        write(tmp_path, with_line("model.overrides", "num_hidden_layers = 1"))
    )
    assert model_source(smaller).config.num_hidden_layers == 1
    (tmp_path / "empty_model").mkdir()
    no_config = load_train_config(
        write(tmp_path, MINIMAL.replace('preset = "tiny"', 'path = "empty_model"'))
    )
    with pytest.raises(ConfigError, match=r"empty_model has no config.json"):
        model_source(no_config)
    with pytest.raises(ConfigError, match="overrides only apply to a preset"):
        train_config_from_dict(
            {**_dict(), "model": {"path": "m", "overrides": {"num_hidden_layers": 1}}}
        )


def _dict() -> dict:
    from usp.config.toml import tomllib

    return tomllib.loads(MINIMAL)


# ----------------------------------------------------------------------------- lengths
def plan_like(ring: int, ulysses: int, layout: str = "zigzag"):
    import math

    multiple = ring * (math.lcm(2, ulysses) if layout == "zigzag" else ulysses)
    return SimpleNamespace(
        ring_degree=ring, ulysses_degree=ulysses, layout=layout, sequence_multiple=multiple
    )


def test_sequence_length_and_document_multiple(tmp_path):
    job = load_train_config(write(tmp_path, MINIMAL.replace("seq_len = 64", "seq_len = 100")))
    with pytest.raises(ConfigError) as info:
        check_lengths(job, plan_like(4, 2))
    assert (
        "seq_len(100) must be a multiple of 8 for the zigzag layout with ring=4, ulysses=2"
        in str(info.value)
    )
    assert "seq_len = 104" in str(info.value)
    job = load_train_config(write(tmp_path, MINIMAL))
    assert check_lengths(job, plan_like(2, 2)) == 4  # auto: 2 * ring
    assert check_lengths(job, plan_like(2, 2, "contiguous")) == 2  # auto: ring
    fixed = load_train_config(write(tmp_path, with_line("data", "document_multiple = 6")))
    with pytest.raises(ConfigError, match=r"document_multiple\(6\) must be a multiple of 4"):
        check_lengths(fixed, plan_like(2, 2))
    with pytest.raises(
        ConfigError, match=r"seq_len\(64\) must be a multiple of \[data\] document_multiple\(6\)"
    ):
        check_lengths(fixed, plan_like(1, 1))


# ----------------------------------------------------------------------------- command line
def test_parser_flags():
    args = build_parser().parse_args(
        ["train", "c.toml", "--steps", "5", "--output", "o", "--ulysses", "auto", "--ring", "2",
         "--dp", "1", "--resume", "--device", "cpu"]
    )  # fmt: skip
    assert (args.steps, args.output, args.ulysses, args.ring, args.dp) == (5, "o", "auto", 2, 1)
    assert args.resume and args.device == "cpu"
    with redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        build_parser().parse_args(["train", "c.toml", "--steps", "auto"])


def test_command_reports_config_errors_with_status_2(tmp_path, capsys):
    path = write(tmp_path, with_line("train", "stepz = 3"))
    args = build_parser().parse_args(["train", str(path)])
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("usp train: error: ") and "[train] unknown key 'stepz'" in err


@pytest.mark.parametrize("value", ["'yes'", "'false'", "1"])
def test_command_refuses_a_flag_of_another_type_in_the_overrides(tmp_path, capsys, value):
    """``output_router_logits = "false"`` is a string (truthy): it would train with the
    auxiliary loss. Refused like the numbers next to it, exit 2, one line, no traceback."""
    text = MINIMAL.replace('preset = "tiny"', 'preset = "qwen3-moe-tiny"')
    path = write(tmp_path, text + f"\n[model.overrides]\noutput_router_logits = {value}\n")
    with pytest.raises(ConfigError, match=r"\[model.overrides\] output_router_logits must be "):
        model_source(load_train_config(path))
    args = build_parser().parse_args(
        ["train", str(path), "--output", str(tmp_path / "out"), "--ulysses", "1", "--ring", "1",
         "--dp", "1", "--device", "cpu"]
    )  # fmt: skip
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    got = "1" if value == "1" else f"the string {value} (write it without quotes)"
    expected = f"{path}: [model.overrides] output_router_logits must be true or false, got {got}"
    assert err == f"usp train [rank 0]: error: {expected}\n", err


def test_command_refuses_cuda_without_cuda(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = build_parser().parse_args(["train", str(write(tmp_path, MINIMAL)), "--device", "cuda"])
    assert args.run(args) == 2
    assert "CUDA is not available; use --device cpu" in capsys.readouterr().err


def test_command_without_torchrun_checks_the_world_size(tmp_path, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    path = write(tmp_path, MINIMAL)  # 1 node x 4 ranks, run as one process
    args = build_parser().parse_args(["train", str(path), "--output", str(tmp_path / "out")])
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert "usp train" in err and "[cluster]" in err and "job.toml" in err, err
    import torch.distributed as dist

    assert not dist.is_initialized(), "the world of one is torn down after the error"


def test_a_grid_for_more_ranks_names_the_flags_that_fix_it(tmp_path, capsys, monkeypatch):
    """One process, ``gpus_per_node = "auto"`` and a u2 x r2 grid: one line, exit 2,
    naming usp train's flags that run it here (``--ulysses 1 --ring 1 --dp 1``) or the
    launch of 4 ranks; with those flags it trains."""
    from cli_flags import assert_flags_are_the_commands

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    text = MINIMAL.replace("gpus_per_node = 4", 'gpus_per_node = "auto"')
    path = write(tmp_path, text.replace("steps = 10", "steps = 1"))
    out = str(tmp_path / "out")
    args = build_parser().parse_args(["train", str(path), "--output", out])
    assert args.run(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "ulysses(2) * ring(2) = 4 does not divide the running job's world_size(1)" in err
    assert "give --ulysses 1 --ring 1 --dp 1" in err, err
    assert f"launch 4 ranks: usp train {path} --nproc-per-node 4" in err, err
    named = assert_flags_are_the_commands(err, "train")
    assert named == {"--ulysses", "--ring", "--dp", "--nproc-per-node"}, named
    args = build_parser().parse_args(
        ["train", str(path), "--output", out, "--ulysses", "1", "--ring", "1", "--dp", "1"]
    )
    assert args.run(args) == 0, capsys.readouterr().err


# ----------------------------------------------------------------------------- one config system
def test_model_section_means_one_thing_per_kind_of_file(tmp_path):
    # a training config names its model; head counts there are refused with the reason
    mixed = with_line("model", "num_heads = 32")
    with pytest.raises(ConfigError, match=r"\[model\] num_heads: a training config takes the head"):
        load_train_config(write(tmp_path, mixed))
    # a topology-only config gives head counts; a model to train there is refused
    from usp.config import load_config

    topo_only = "[cluster]\nnodes = 1\ngpus_per_node = 4\n[parallel]\nulysses = 2\nring = 2\n"
    path = write(tmp_path, topo_only + '[model]\npreset = "tiny"\n', "topo.toml")
    with pytest.raises(ConfigError, match=r"topo.toml: \[model\] preset names a model to train"):
        load_config(path)
    path = write(tmp_path, topo_only + "[model]\nnum_heads = 8\n", "heads.toml")
    assert load_config(path).model.num_kv_heads == 8


def test_one_reader_for_training_configs(tmp_path):
    from usp.config import MAX_CONFIG_BYTES

    big = write(tmp_path, MINIMAL + "#" * MAX_CONFIG_BYTES)
    with pytest.raises(ConfigError, match=f"larger than {MAX_CONFIG_BYTES} bytes"):
        load_train_config(big)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe" + MINIMAL.encode())
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_train_config(binary)
    with pytest.raises(ConfigError, match="is a directory, not a config file"):
        load_train_config(tmp_path)


def test_overrides_come_from_every_sections_fields(tmp_path):
    from usp.train.config import OVERRIDE_KEYS

    path = write(tmp_path, MINIMAL)
    job = load_train_config(
        path, layout="contiguous", synthetic_length=10, gpus_per_node=2, lr=0.5, steps=None
    )
    assert job.topology.attention.layout == "contiguous"
    assert job.topology.cluster.gpus_per_node == 2
    assert (job.data.synthetic_length, job.train.lr, job.train.steps) == (10, 0.5, 10)
    again = job.with_overrides(ring=1)  # applied on top of the earlier ones
    assert (again.topology.parallel.ring, again.topology.attention.layout) == (1, "contiguous")
    assert OVERRIDE_KEYS["document_multiple"] == "data" and OVERRIDE_KEYS["nodes"] == "cluster"
    with pytest.raises(ConfigError, match="unknown override 'preset'; known overrides: nodes"):
        load_train_config(path, preset="tiny")
    with pytest.raises(
        ConfigError, match=r"job.toml: \[data\] synthetic_length must be an integer"
    ):
        load_train_config(path, synthetic_length=1)


def test_a_key_two_sections_share_is_no_flat_override():
    from dataclasses import dataclass

    from usp.config import apply_overrides, override_keys

    @dataclass
    class A:
        size: int = 1
        name: str = "a"

    @dataclass
    class B:
        size: int = 2

    keys = override_keys({"a": A, "b": B})
    assert keys == {"name": "a"}
    assert apply_overrides({"a": {"size": 3}}, {"name": "x"}, keys) == {
        "a": {"size": 3, "name": "x"}
    }
    with pytest.raises(ConfigError, match="unknown override 'size'; known overrides: name"):
        apply_overrides({}, {"size": 3}, keys)


# ----------------------------------------------------------------------------- usp topo
def test_usp_topo_runs_the_train_and_data_checks(tmp_path, capsys):
    from usp.cli import main

    assert main(["topo", str(write(tmp_path, MINIMAL))]) == 0
    bad_length = write(tmp_path, MINIMAL.replace("seq_len = 64", "seq_len = 62"), "len.toml")
    assert main(["topo", str(bad_length)]) == 2
    err = capsys.readouterr().err
    assert f"usp topo: error: {bad_length}: [train] seq_len(62) must be a multiple of 4" in err, err
    batch = write(tmp_path, MINIMAL.replace("global_batch = 4", "global_batch = 3"), "b.toml")
    assert main(["topo", str(batch), "--ulysses", "2", "--ring", "1", "--dp", "2"]) == 2
    assert "[train] global_batch(3) is not a multiple of dp(2) * micro_batch(1)" in (
        capsys.readouterr().err
    )
    files = MINIMAL.replace('source = "synthetic"', 'source = "jsonl"\nfiles = ["d/*.jsonl"]')
    glob_job = write(tmp_path, files, "files.toml")
    # files that are not on this machine (a cluster's): named under warnings, not an error
    assert main(["topo", str(glob_job)]) == 0
    out = capsys.readouterr().out
    assert "[data] not checked: a file it names is not on this machine" in out, out
    assert "[data] files pattern 'd/*.jsonl' matches no file" in out, out
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text('{"text": "hi"}\n')
    assert main(["topo", str(glob_job)]) == 0, capsys.readouterr().err


def test_config_overrides_never_clash_with_a_parameter_name(tmp_path):
    """The config readers and Plan.from_config take every override as a keyword: a name
    that is also one of their own or an internal function's parameters (``path``,
    ``source``, ``self``, ...) is an override like any other -- applied when it is a key
    (``source``: [data] source), else the one "unknown override" error -- never a
    TypeError about a signature."""
    import usp
    from usp.config import config_from_dict, load_config
    from usp.train.config import train_config_from_dict

    topo = write(
        tmp_path,
        "[cluster]\nnodes = 1\ngpus_per_node = 4\n[parallel]\nulysses = 2\nring = 2\n",
        "t.toml",
    )
    job = write(tmp_path, MINIMAL)
    readers = {
        "load_config": lambda **kw: load_config(topo, **kw),
        "config_from_dict": lambda **kw: config_from_dict(load_config(topo).to_dict(), **kw),
        "UspConfig.with_overrides": lambda **kw: load_config(topo).with_overrides(**kw),
        "Plan.from_config": lambda **kw: usp.Plan.from_config(topo, topology=None, **kw),
        "load_train_config": lambda **kw: load_train_config(job, **kw),
        "train_config_from_dict": lambda **kw: train_config_from_dict(
            load_train_config(job).tables, **kw
        ),
        "TrainJobConfig.with_overrides": lambda **kw: load_train_config(job).with_overrides(**kw),
    }
    for name, read in readers.items():
        for keyword in ("path", "self", "data", "overrides", "config_or_path", "cls"):
            with pytest.raises(ConfigError, match=f"unknown override '{keyword}'"):
                read(**{keyword: 1})
        if name in ("config_from_dict", "train_config_from_dict"):
            assert read(source="x.toml").source == "x.toml"  # their own parameter: the file
        elif name in ("load_config", "UspConfig.with_overrides", "Plan.from_config"):
            with pytest.raises(ConfigError, match="unknown override 'source'"):
                read(source="x")
        else:  # a training config's override of [data] source
            assert read(steps=3).train.steps == 3
            with pytest.raises(ConfigError, match=r"\[data\] source must be one of"):
                read(source="nowhere")


def test_config_json_is_read_once_per_start(tmp_path, monkeypatch):
    """usp train reads a checkpoint's config.json once (:func:`model_source`) and hands
    it on: the plan's head counts (``topology_config``) and the one-process weights
    (``build_model`` -> ``from_pretrained``) read no file again; the same from_pretrained
    without the file config reads it, and builds the same model."""
    import torch

    import usp.models.config as model_config
    import usp.models.family as family
    from usp.models import PRESETS, Llama
    from usp.sp.plan import Plan
    from usp.train.components import build_model

    torch.manual_seed(0)
    Llama(PRESETS["tiny"]).save_pretrained(tmp_path / "model")
    text = MINIMAL.replace('preset = "tiny"', f'path = "{tmp_path / "model"}"')
    job = load_train_config(write(tmp_path, text))
    reads = []
    real = model_config.read_config_json

    def counted(path):
        reads.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(model_config, "read_config_json", counted)
    monkeypatch.setattr(family, "read_config_json", counted)
    source = model_source(job)
    assert reads == ["config.json"] and source.file_config == source.config
    topology_config(job, source)
    model = build_model(job, source, Plan(None))
    assert reads == ["config.json"], "nothing read config.json a second time"
    again = Llama.from_pretrained(tmp_path / "model", dtype=torch.float32)
    assert reads == ["config.json"] * 2  # (without file_config= it reads the file)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
