"""Config files, "auto" resolution and the ``usp topo`` command."""

import json
import re
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

import pytest
from cli_flags import assert_flags_are_the_commands

from usp.cli import main
from usp.config import ConfigError, config_from_dict, load_config
from usp.process_groups.rank_math import RING_IN_NODE, RankMap

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"

# name -> (world_size, ranks_per_node, ulysses, ring, dp)
SHIPPED = {
    "cpu_demo.toml": (4, 4, 2, 2, 1),
    "1node_8gpu.toml": (8, 8, 8, 1, 1),
    "2node_llama3_8b.toml": (16, 8, 8, 2, 1),
    "8node_llama3_70b.toml": (64, 8, 8, 4, 2),
}


def run_cli(capsys, *argv):
    code = main(["topo", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path, text, name="x.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


BASE = """
[cluster]
nodes = 2
gpus_per_node = 8

[parallel]
ulysses = 8
ring = 2
"""


# ----------------------------------------------------------------------------- shipped configs
def _is_topology_config(path: Path) -> bool:
    """Topology configs have only topology sections (trainer configs add [train], [data]...;
    the trainer's tests cover those)."""
    with open(path, "rb") as f:
        return set(tomllib.load(f)) <= {"cluster", "parallel", "attention", "model"}


def test_every_shipped_config_is_tested():
    shipped = [p.name for p in CONFIGS.glob("*.toml") if _is_topology_config(p)]
    assert sorted(shipped) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_config_resolves(name):
    w, rpn, u, r, d = SHIPPED[name]
    resolved = load_config(CONFIGS / name).resolve()
    assert (resolved.world_size, resolved.ulysses, resolved.ring, resolved.dp) == (w, u, r, d)
    assert resolved.rank_map == RankMap(w, rpn, u, r, d)
    assert resolved.kv_replication == 1
    assert resolved.config.is_resolved and resolved.config.source == str(CONFIGS / name)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_topo_json_matches_rank_math(capsys, name):
    w, rpn, u, r, d = SHIPPED[name]
    code, out, err = run_cli(capsys, CONFIGS / name, "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    m = RankMap(w, rpn, u, r, d)
    assert data["world_size"] == w
    assert data["ranks"] == [
        {
            "rank": i.rank,
            "node": i.node,
            "local_rank": i.local_rank,
            "dp": i.dp,
            "ring": i.ring,
            "ulysses": i.ulysses,
            "sp": i.sp,
        }
        for i in m.ranks
    ]
    assert data["groups"] == {
        "ulysses": m.ulysses_groups,
        "ring": m.ring_groups,
        "sp": m.sp_groups,
        "dp": m.dp_groups,
    }
    assert data["degrees"] == {"ulysses": u, "ring": r, "dp": d, "sp": u * r}
    assert data["attention"] == {
        "layout": "zigzag",
        "ring_impl": "p2p",
        "backend": "auto",
        "linear_backend": "auto",
        "linear_conv_backend": "auto",
    }


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_topo_text(capsys, name):
    w, rpn, u, r, d = SHIPPED[name]
    code, out, err = run_cli(capsys, CONFIGS / name)
    assert code == 0 and err == ""
    assert f"dp {d} x ring {r} x ulysses {u} (sp {u * r}), placement ulysses-in-node" in out
    assert f"{w} ranks = {w // rpn} node(s) x {rpn} ranks per node" in out
    assert "layout=zigzag ring_impl=p2p backend=auto" in out
    m = RankMap(w, rpn, u, r, d)
    last = m.coords_of(w - 1)
    grid_row = next(
        line for line in out.splitlines() if line.strip().startswith(f"node {w // rpn - 1} ")
    )
    assert grid_row.split()[-1] == f"{last.dp}.{last.ring}.{last.ulysses}"
    assert f"ulysses  {d * r} group" in out and f"of {u}:" in out


def test_topo_text_2node_details(capsys):
    code, out, _ = run_cli(capsys, CONFIGS / "2node_llama3_8b.toml")
    assert code == 0
    assert "  node 1  0.1.0    0.1.1" in out
    assert "ulysses  2 groups of 8: [0-7] [8-15]" in out
    assert "ring     8 groups of 2: [0,8] [1,9] [2,10]" in out
    assert "4 query head(s) and 1 KV head(s), KV replication x1" in out
    assert "warnings: none" in out


def test_topo_overrides_and_warnings(capsys):
    path = CONFIGS / "2node_llama3_8b.toml"
    code, out, _ = run_cli(
        capsys, path, "--ulysses", "16", "--ring", "1", "--allow-cross-node-ulysses", "--json"
    )
    data = json.loads(out)
    assert code == 0 and data["degrees"]["ulysses"] == 16 and data["kv_replication"] == 2
    kv_warning = next(w for w in data["warnings"] if "replicated" in w)
    assert "replicated x2 (8 -> 16)" in kv_warning
    assert "8192 instead of 4096 bytes per token per layer" in kv_warning  # 2 * 8 * 128 * 2 B
    assert any("1 of 1 Ulysses groups span nodes" in w for w in data["warnings"])

    code, out, _ = run_cli(
        capsys,
        path,
        "--placement",
        "ring-in-node",
        "--ulysses",
        "2",
        "--ring",
        "8",
        "--allow-cross-node-ulysses",
    )
    assert code == 0
    assert "while the ring stays inside a node; consider placement ulysses-in-node" in out
    assert "sp       1 group of 16: [0,8,1,9,2,10,... 16 ranks]" in out

    code, out, _ = run_cli(capsys, CONFIGS / "cpu_demo.toml")
    assert "ulysses 2 uses 2 of 4 ranks per node; ulysses 4 x ring 1 would keep more traffic" in out


def test_topo_world_size_and_cluster_overrides(capsys):
    path = CONFIGS / "8node_llama3_70b.toml"
    code, out, _ = run_cli(capsys, path, "--world-size", "128", "--json")
    data = json.loads(out)
    assert code == 0 and data["degrees"] == {"ulysses": 8, "ring": 4, "dp": 4, "sp": 32}
    assert data["nodes"] == 16 and data["ranks_per_node"] == 8
    code, out, _ = run_cli(
        capsys,
        path,
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--ulysses",
        "4",
        "--ring",
        "2",
        "--json",
    )
    data = json.loads(out)
    assert code == 0 and data["world_size"] == 8 and data["degrees"]["dp"] == 1
    assert data["groups"]["ring"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_topo_big_world_is_abbreviated(capsys):
    code, out, _ = run_cli(capsys, CONFIGS / "8node_llama3_70b.toml", "--world-size", "1024")
    assert code == 0
    assert "dp 32 x ring 4 x ulysses 8" in out
    assert "... (120 more nodes)" in out
    assert "  node 127  31.3.0" in out
    assert "dp       32 groups of 32: [0,32,...,992]" in out
    assert len(out.splitlines()) < 40


# ----------------------------------------------------------------------------- errors
def expect_cli_error(capsys, path, *argv) -> str:
    code, out, err = run_cli(capsys, path, *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"usp topo: error: {path}: ")
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "text, message",
    [
        (
            BASE.replace("ring = 2", "ring = 2\nulyses = 8"),
            "[parallel] unknown key 'ulyses'; expected one of ulysses, ring, dp,",
        ),
        (
            BASE + "\n[paralel]\nring = 2\n",
            "unknown section [paralel]; expected [cluster], [parallel], [attention], [model]",
        ),
        (
            BASE.replace("ulysses = 8", 'ulysses = "eight"'),
            '[parallel] ulysses must be an integer >= 1 or "auto", got "eight"',
        ),
        (
            BASE.replace("ring = 2", "ring = true"),
            '[parallel] ring must be an integer >= 1 or "auto", got true',
        ),
        (
            BASE.replace("nodes = 2", "nodes = 0"),
            '[cluster] nodes must be an integer >= 1 or "auto", got 0',
        ),
        (
            BASE.replace("gpus_per_node = 8", 'gpus_per_node = "many"'),
            '[cluster] gpus_per_node must be an integer >= 1 or "auto", got "many"',
        ),
        (BASE.replace("gpus_per_node = 8", ""), "[cluster] missing required key 'gpus_per_node'"),
        (
            BASE.replace("ring = 2", "ring = 2\nplacement = 'rings'"),
            '[parallel] placement must be one of "ulysses-in-node", "ring-in-node", got "rings"',
        ),
        (
            BASE.replace("ring = 2", "ring = 2\nallow_cross_node_ulysses = 1"),
            "[parallel] allow_cross_node_ulysses must be true or false, got 1",
        ),
        (
            BASE + '[attention]\nbackend = "fast"\n',
            '[attention] backend must be one of "auto", "cudnn", "flash_attn", "flash", "efficient", "cpu", "math", got "fast"',
        ),
        (
            BASE + '[attention]\nlayout = "striped"\n',
            '[attention] layout must be one of "zigzag", "contiguous", got "striped"',
        ),
        (
            BASE + '[attention]\nlinear_backend = "triton"\n',
            '[attention] linear_backend must be one of "auto", "torch", "fla", got "triton"',
        ),
        (
            BASE + '[attention]\nlinear_conv_backend = "fla"\n',
            '[attention] linear_conv_backend must be one of "auto", "torch", "causal_conv1d", '
            'got "fla"',
        ),
        (
            BASE + "[model]\nnum_heads = 30\nnum_kv_heads = 8\n",
            "[model] num_heads(30) is not a multiple of num_kv_heads(8)",
        ),
        (BASE + "[model]\nnum_heads = 32\nhead_size = 128\n", "[model] unknown key 'head_size'"),
        (
            "parallel = 3\n" + BASE.split("[parallel]")[0],
            "parallel must be a [parallel] table, got 3",
        ),
        (BASE.split("[parallel]")[0], "missing section [parallel]"),
    ],
)
def test_malformed_config(tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: {message}" or str(info.value).startswith(
        f"{path}: {message}"
    )
    assert message in expect_cli_error(capsys, path)


@pytest.mark.parametrize(
    "text, messages",
    [
        (
            BASE.replace("ring = 2", "ring = 4\ndp = 2"),
            ["[parallel] ring(4) * ulysses(8) * dp(2) = 64 != world_size(16)"],
        ),
        (
            BASE.replace("ring = 2", "ring = 3"),
            ["[parallel] ring(3) * ulysses(8) = 24 does not divide world_size(16)"],
        ),
        (
            BASE.replace("ulysses = 8", "ulysses = 16").replace("ring = 2", "ring = 1"),
            [
                "Ulysses group 0",
                "spans nodes 0, 1",
                "ulysses_degree=8",
                "set allow_cross_node_ulysses = true",
            ],
        ),
        (
            BASE.replace("ring = 2", "ring = 2\nplacement = 'ring-in-node'"),
            [
                "Ulysses group 0 (ranks [0, 2, 4, 6, 8, 10, 12, 14]) spans nodes 0, 1",
                "placement 'ulysses-in-node'",
            ],
        ),
        (
            BASE.replace("nodes = 2", "nodes = 1")
            .replace("gpus_per_node = 8", "gpus_per_node = 6")
            .replace("ulysses = 8", "ulysses = 6")
            .replace("ring = 2", "ring = 1")
            + "[model]\nnum_heads = 32\nnum_kv_heads = 8\n",
            [
                "[model] does not fit [parallel] ulysses = 6: num_heads(32) is not divisible by ulysses(6)",
                "valid (ulysses, ring) pairs for sp_size=6 with 32 heads / 8 KV heads and 6 ranks per node: (1, 6), (2, 3)",
            ],
        ),
    ],
)
def test_config_that_does_not_fit(tmp_path, capsys, text, messages):
    path = write(tmp_path, text)
    config = load_config(path)  # well-formed: the error comes when resolving
    with pytest.raises(ConfigError) as info:
        config.resolve()
    assert str(info.value).startswith(f"{path}: ")
    err = expect_cli_error(capsys, path)
    for message in messages:
        assert message in str(info.value) and message in err


def test_toml_syntax_error_and_missing_file(tmp_path, capsys):
    path = write(tmp_path, BASE.replace("ring = 2", "ring = = 2"))
    err = expect_cli_error(capsys, path)
    assert "invalid TOML" in err and "line" in err
    missing = tmp_path / "nope.toml"
    assert "no such config file" in expect_cli_error(capsys, missing)


def test_cli_argument_errors(capsys):
    with pytest.raises(SystemExit) as info:
        main(["topo", str(CONFIGS / "cpu_demo.toml"), "--ulysses", "eight"])
    assert info.value.code == 2
    assert (
        "usp topo: error: argument --ulysses: expected an integer or \"auto\", got 'eight'"
        in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        main([])


# ----------------------------------------------------------------------------- auto + overrides
def _config(parallel, nodes=2, gpus=8, model=None):
    data = {"cluster": {"nodes": nodes, "gpus_per_node": gpus}, "parallel": parallel}
    if model:
        data["model"] = model
    return config_from_dict(data)


LLAMA8B = {"num_heads": 32, "num_kv_heads": 8}


@pytest.mark.parametrize(
    "parallel, nodes, gpus, model, expected",
    [
        ({"ulysses": "auto", "ring": "auto"}, 2, 8, LLAMA8B, (8, 2, 1)),
        (
            {"ulysses": "auto", "ring": "auto"},
            2,
            8,
            {"num_heads": 12, "num_kv_heads": 4},
            (4, 4, 1),
        ),
        ({"ulysses": "auto", "ring": "auto"}, 2, 8, None, (8, 2, 1)),
        ({"ulysses": "auto", "ring": 2}, 4, 8, LLAMA8B, (8, 2, 2)),
        ({"ulysses": "auto", "ring": 2, "dp": 2}, 2, 8, None, (4, 2, 2)),
        ({"ulysses": 8, "ring": "auto", "dp": 2}, 4, 8, None, (8, 2, 2)),
        ({"ulysses": 8, "ring": "auto"}, 4, 8, None, (8, 4, 1)),
        ({"ulysses": "auto", "ring": "auto", "dp": 2}, 2, 8, LLAMA8B, (8, 1, 2)),
        ({"ulysses": "auto", "ring": "auto", "placement": "ring-in-node"}, 2, 8, None, (1, 16, 1)),
        ({"ulysses": "auto", "ring": "auto", "placement": "ring-in-node"}, 1, 8, None, (8, 1, 1)),
        ({"ulysses": "auto", "ring": 1}, 1, 6, {"num_heads": 8, "num_kv_heads": 8}, (2, 1, 3)),
    ],
)
def test_auto_resolution(parallel, nodes, gpus, model, expected):
    resolved = _config(parallel, nodes, gpus, model).resolve()
    assert (resolved.ulysses, resolved.ring, resolved.dp) == expected


def test_auto_dp_that_does_not_divide():
    with pytest.raises(
        ConfigError,
        match=r"\[parallel\] ring\(3\) \* ulysses\(2\) = 6 does not divide world_size\(16\)",
    ):
        _config({"ulysses": 2, "ring": 3}).resolve()
    with pytest.raises(
        ConfigError,
        match=r"\[parallel\] ulysses\(8\) \* dp\(3\) = 24 does not divide world_size\(16\)",
    ):
        _config({"ulysses": 8, "ring": "auto", "dp": 3}).resolve()
    with pytest.raises(
        ConfigError, match=r"\[parallel\] dp\(3\) = 3 does not divide world_size\(16\)"
    ):
        _config({"ulysses": "auto", "ring": "auto", "dp": 3}).resolve()


def test_overrides(tmp_path):
    path = write(tmp_path, BASE)
    config = load_config(
        path, ulysses=4, ring=None, dp="auto", num_heads=32, num_kv_heads=8, backend="cudnn"
    )
    assert config.parallel.ulysses == 4 and config.parallel.ring == 2
    assert config.model.num_heads == 32 and config.attention.backend == "cudnn"
    assert config.resolve().dp == 2
    with pytest.raises(ConfigError, match="unknown override 'ulyses'"):
        load_config(path, ulyses=4)
    with pytest.raises(
        ConfigError, match=r'\[parallel\] ulysses must be an integer >= 1 or "auto", got 0'
    ):
        load_config(path, ulysses=0)
    again = config.with_overrides(placement=RING_IN_NODE, allow_cross_node_ulysses=True)
    assert again.parallel.placement == RING_IN_NODE and again.source == str(path)
    assert again.to_dict()["model"] == {"num_heads": 32, "num_kv_heads": 8, "head_dim": None}


def test_resolve_with_other_world_size_keeps_node_size():
    resolved = _config({"ulysses": 8, "ring": 2, "dp": "auto"}).resolve(world_size=64)
    assert resolved.config.cluster.nodes == 8 and resolved.dp == 4
    with pytest.raises(
        ConfigError, match=r"world_size\(20\) is not a multiple of \[cluster\] gpus_per_node\(8\)"
    ):
        _config({"ulysses": 8, "ring": 2}).resolve(world_size=20)


def test_kv_heads_default_to_heads():
    config = _config({"ulysses": 8, "ring": 2}, model={"num_heads": 16})
    assert config.model.num_kv_heads == 16 and config.resolve().kv_replication == 1


# ----------------------------------------------------------------------------- entry point
def test_python_dash_m_usp_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "usp", "topo", "examples/configs/2node_llama3_8b.toml", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["world_size"] == 16
    assert data["groups"]["ring"][0] == [0, 8]


# ----------------------------------------------------------------------------- bad inputs, huge sizes
def test_paths_that_are_not_config_files(tmp_path, capsys):
    assert "is a directory, not a config file" in expect_cli_error(capsys, tmp_path)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(BASE.encode() + b"# caf\xe9\n")
    err = expect_cli_error(capsys, latin1)
    assert f"not UTF-8 text (byte {len(BASE) + 5}: b'\\xe9'); TOML files are UTF-8" in err
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (2 << 20))
    assert "larger than 1048576 bytes" in expect_cli_error(capsys, big)
    nested = tmp_path / "nested.toml"
    nested.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert "invalid TOML" in expect_cli_error(capsys, nested)


def test_sizes_are_checked_before_anything_proportional_is_built(tmp_path, capsys):
    import time

    huge = BASE.replace("nodes = 2", "nodes = 1").replace(
        "gpus_per_node = 8", "gpus_per_node = 100000000000"
    )
    start = time.perf_counter()
    err = expect_cli_error(capsys, write(tmp_path, huge))
    assert "world_size(100000000000) exceeds the largest world torch.distributed can launch" in err
    # a world of ten million ranks with auto degrees: answered, abbreviated, fast
    code, out, err = run_cli(
        capsys, CONFIGS / "1node_8gpu.toml", "--world-size", "10000000", "--ring", "auto"
    )
    assert code == 0 and err == ""
    assert "dp 1 x ring 1250000 x ulysses 8 (sp 10000000)" in out
    assert "ring     8 groups of 1250000: [0,8,...,9999992]" in out
    assert len(out.splitlines()) < 40
    err = expect_cli_error(
        capsys, CONFIGS / "1node_8gpu.toml", "--world-size", "10000000", "--json"
    )
    assert "--json lists every rank and group; 10000000 ranks is more than 65536" in err
    # the biggest world torch can launch, Ulysses groups spanning nodes (counted, not listed)
    code, out, _ = run_cli(
        capsys,
        CONFIGS / "2node_llama3_8b.toml",
        "--world-size",
        str(2**31 - 1 - (2**31 - 1) % 16),
        "--ulysses",
        "16",
        "--ring",
        "auto",
        "--allow-cross-node-ulysses",
    )
    assert code == 0 and "134217727 of 134217727 Ulysses groups span nodes" in out
    assert time.perf_counter() - start < 3.0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--world-size", "1e7"], "argument --world-size: expected an integer >= 1, got '1e7'"),
        (["--world-size", "0"], "argument --world-size: expected an integer >= 1, got 0"),
        (["--nodes", "auto"], "argument --nodes: expected an integer >= 1, got 'auto'"),
        (["--ring", "-3"], "argument --ring: expected an integer >= 1, got -3"),
        (["--placement", "nodes"], "argument --placement: invalid choice: 'nodes'"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main(["topo", str(CONFIGS / "cpu_demo.toml"), *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_auto_cluster_in_usp_topo(tmp_path, capsys):
    """Without a launch an "auto" cluster value comes from the grid's own world size
    (ulysses 8 x ring 2, dp auto: the fewest ranks that fill whole nodes) or from
    --world-size / --gpus-per-node; where the grid leaves the world open too, the error
    names flags usp topo has."""
    path = write(tmp_path, BASE.replace("nodes = 2", 'nodes = "auto"'))
    code, out, _ = run_cli(capsys, path, "--json")
    assert code == 0 and (json.loads(out)["nodes"], json.loads(out)["world_size"]) == (2, 16)
    code, out, _ = run_cli(capsys, path, "--world-size", "32", "--json")
    assert code == 0 and json.loads(out)["nodes"] == 4
    path = write(tmp_path, BASE.replace("gpus_per_node = 8", 'gpus_per_node = "auto"'))
    code, out, _ = run_cli(capsys, path, "--json")
    shape = json.loads(out)
    assert code == 0 and (shape["ranks_per_node"], shape["world_size"]) == (8, 16)
    code, out, _ = run_cli(capsys, path, "--world-size", "32", "--json")
    shape = json.loads(out)
    assert code == 0 and (shape["ranks_per_node"], shape["degrees"]["dp"]) == (16, 2)
    code, out, _ = run_cli(capsys, path, "--gpus-per-node", "8", "--json")
    assert code == 0 and json.loads(out)["world_size"] == 16
    for cluster in ('nodes = "auto"', 'gpus_per_node = "auto"'):
        key = cluster.split()[0]
        text = BASE.replace(f"{key} = {2 if key == 'nodes' else 8}", cluster)
        path = write(tmp_path, text.replace("ulysses = 8", 'ulysses = "auto"'))
        err = expect_cli_error(capsys, path)
        assert f"{cluster} is taken from the launch" in err, err
        assert_flags_are_the_commands(err, "topo")
        fix = "--set cluster.nodes=2" if key == "nodes" else "--set cluster.gpus_per_node=8"
        code, out, _ = run_cli(capsys, path, "--json", *fix.split())
        assert code == 0 and json.loads(out)["world_size"] == 16


def test_training_configs_are_read_the_way_usp_train_reads_them(tmp_path, capsys):
    # `usp topo` on a `usp train` config: the model's real head counts when available ...
    finetune = CONFIGS / "cpu_finetune.toml"
    # its cluster shape is "auto" (taken from the launch): give the ranks per node here
    code, out, err = run_cli(capsys, finetune, "--json", "--gpus-per-node", "4")
    assert code == 0 and err == "", err
    data = json.loads(out)
    assert data["world_size"] == 4 and data["model"]["num_heads"] > 0
    assert not any("head counts not checked" in w for w in data["warnings"])
    # ... and a note, not an error, when its checkpoint directory is not on this machine
    text = finetune.read_text()
    text = re.sub(r'(?m)^preset = "tiny".*$', f'path = "{tmp_path / "absent"}"', text)
    path = write(tmp_path, text, "remote_model.toml")
    code, out, _ = run_cli(capsys, path, "--ulysses", "4", "--ring", "1", "--gpus-per-node", "4")
    assert code == 0
    assert "head counts not checked: the model's config is not readable here" in out
    assert "dp 1 x ring 1 x ulysses 4" in out


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_usp_topo_checks_every_shipped_config_on_any_machine(capsys, name):
    """Every file of examples/configs/ (topology and training configs alike) passes `usp
    topo` here, where the cluster's data files and checkpoints are not: what cannot be
    checked is named in the output, not an error (a missing data file is one)."""
    code, out, err = run_cli(capsys, CONFIGS / name)
    assert code == 0 and err == "", err
    if "/data/" in (CONFIGS / name).read_text():  # a cluster's data path
        assert "[data] not checked" in out


def test_usp_topo_notes_a_missing_data_file_and_usp_train_refuses_it(tmp_path, capsys):
    text = (CONFIGS / "cpu_finetune.toml").read_text()
    text = re.sub(
        r"(?ms)^\[data\].*?(?=^\[)",
        '[data]\nsource = "jsonl"\nfiles = ["/absent/x.jsonl"]\ntokenizer = "byte"\n\n',
        text,
    )
    path = write(tmp_path, text, "remote_data.toml")
    code, out, err = run_cli(capsys, path, "--gpus-per-node", "4")
    assert code == 0 and err == ""
    assert "[data] not checked: a file it names is not on this machine" in out
    assert "/absent/x.jsonl does not exist" in out
    # the trainer's own check is unchanged: the same file is an error there
    from usp.errors import MissingDataFile
    from usp.train.components import model_source, prepare_data
    from usp.train.config import train_config_from_dict

    job = train_config_from_dict(tomllib.loads(text), source=str(path))
    with pytest.raises(MissingDataFile, match="does not exist"):
        prepare_data(job, model_source(job), 1)
