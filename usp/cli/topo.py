"""``usp topo CONFIG``: print a config's validated rank map without launching anything.

Reads a topology config, or the topology part of a training config (with the model's
head counts when its config is at hand); options override the file's values. Exit
status: 0 printed, 2 the config is invalid (the reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from usp.cli.args import add_set_argument, int_or_auto, positive_int
from usp.config import ConfigError, ResolvedConfig, UspConfig, config_from_dict, read_toml
from usp.config.overrides import apply_settings, located_in_settings, parse_settings
from usp.process_groups.degrees import HeadLayoutError, valid_degree_pairs
from usp.process_groups.rank_math import (
    PLACEMENTS,
    ULYSSES_IN_NODE,
    RankMap,
    TopologyError,
    fitting_ulysses_degrees,
)
from usp.train.components import topology_config  # the trainer's reading of [model]
from usp.train.config import is_train_config, train_config_from_dict
from usp.train.preflight import check_training_config  # [train]/[data], as usp train

# How much of a big world the text view shows.
_MAX_NODES_SHOWN = 8  # more nodes: the first 6 and the last 2
_MAX_COLUMNS_SHOWN = 16  # more ranks per node: the first 8 and the last 4
_MAX_GROUPS_SHOWN = 8  # more groups: the first 6 and the last 1
_ASSUMED_HEAD_DIM = 128
_BF16_BYTES = 2
# --json lists every rank and group; above this the text view (abbreviated) is the answer.
MAX_JSON_RANKS = 65536


# ----------------------------------------------------------------------------- parser
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``topo`` on the ``usp`` command line."""
    p = subparsers.add_parser(
        "topo",
        help="print the validated rank map of a topology config",
        description="Validate a topology config and print which rank does what, "
        "without launching anything. Options override the config's values.",
    )
    p.add_argument("config", help="path to a TOML topology config")
    p.add_argument("--world-size", type=positive_int, help="default: nodes * gpus_per_node")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--ulysses", type=int_or_auto, help='int or "auto"')
    p.add_argument("--ring", type=int_or_auto, help='int or "auto"')
    p.add_argument("--dp", type=int_or_auto, help='int or "auto"')
    p.add_argument("--nodes", type=positive_int)
    p.add_argument("--gpus-per-node", type=positive_int)
    p.add_argument("--placement", choices=PLACEMENTS)
    p.add_argument(
        "--allow-cross-node-ulysses",
        action="store_true",
        default=None,
        help="allow Ulysses groups to span nodes",
    )
    add_set_argument(p)
    p.set_defaults(run=run_topo)


# ----------------------------------------------------------------------------- usp topo
def run_topo(args: argparse.Namespace) -> int:
    try:
        config, notes = load_topology_config(
            args.config,
            sets=getattr(args, "sets", None) or (),
            ulysses=args.ulysses,
            ring=args.ring,
            dp=args.dp,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            placement=args.placement,
            allow_cross_node_ulysses=args.allow_cross_node_ulysses,
        )
        resolved = config.resolve(args.world_size)
        notes = [
            *notes,
            *check_training_config(args.config, resolved, sets=getattr(args, "sets", None) or ()),
        ]
        if args.json and resolved.world_size > MAX_JSON_RANKS:
            raise ConfigError(
                f"{config.source}: --json lists every rank and group; {resolved.world_size} "
                f"ranks is more than {MAX_JSON_RANKS}. Leave out --json for the abbreviated "
                "text view, or pass a smaller --world-size"
            )
    except (ConfigError, TopologyError, HeadLayoutError) as e:
        print(f"usp topo: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(topo_json(resolved, notes)))
    else:
        print(topo_text(resolved, notes))
    return 0


def load_topology_config(
    path: str, *, sets: Sequence[str] = (), **overrides: Any
) -> tuple[UspConfig, list[str]]:
    """The topology config in ``path`` (with ``--set`` ``sets`` and ``overrides``), and
    notes for the output.

    A training config (``[data]``/``[train]`` sections, a ``[model]`` that names a preset
    or a checkpoint directory) is read the way ``usp train`` reads it, with the model's
    real head counts when its config is at hand; otherwise without head checks, and a
    note says so.
    """
    settings = parse_settings(sets)
    try:
        return _load_topology_config(path, settings, overrides)
    except ConfigError as err:
        raise ConfigError(located_in_settings(str(err), settings)) from None


def _load_topology_config(path, settings, overrides) -> tuple[UspConfig, list[str]]:
    data = apply_settings(read_toml(path), settings)
    if not is_train_config(data):
        return config_from_dict(data, source=path, **overrides), []
    job = train_config_from_dict(data, source=path)
    try:
        config = topology_config(job)
    except ConfigError as e:
        note = f"head counts not checked: the model's config is not readable here ({e})"
        return job.topology.with_overrides(**overrides), [note]
    return config.with_overrides(**overrides), []


def topo_json(resolved: ResolvedConfig, notes: Sequence[str] = ()) -> dict[str, Any]:
    """The rank map as plain JSON types (the ``--json`` output)."""
    m, config = resolved.rank_map, resolved.config
    return {
        "world_size": m.world_size,
        "ranks": [
            {
                k: getattr(info, k)
                for k in ("rank", "node", "local_rank", "dp", "ring", "ulysses", "sp")
            }
            for info in m.ranks
        ],
        "groups": {
            "ulysses": m.ulysses_groups,
            "ring": m.ring_groups,
            "sp": m.sp_groups,
            "dp": m.dp_groups,
        },
        "degrees": {
            "ulysses": m.ulysses_degree,
            "ring": m.ring_degree,
            "dp": m.dp_degree,
            "sp": m.sp_degree,
        },
        "nodes": m.num_nodes,
        "ranks_per_node": m.ranks_per_node,
        "placement": m.placement,
        "attention": config.to_dict()["attention"],
        "model": config.to_dict().get("model"),
        "kv_replication": resolved.kv_replication,
        "warnings": [*notes, *topo_warnings(resolved)],
    }


def topo_text(resolved: ResolvedConfig, notes: Sequence[str] = ()) -> str:
    m, config = resolved.rank_map, resolved.config
    a = config.attention
    lines = [
        f"usp topo: {config.source}",
        f"  world     {m.world_size} ranks = {m.num_nodes} node(s) x {m.ranks_per_node} ranks per node",
        f"  degrees   dp {m.dp_degree} x ring {m.ring_degree} x ulysses {m.ulysses_degree} "
        f"(sp {m.sp_degree}), placement {m.placement}",
        f"  attention layout={a.layout} ring_impl={a.ring_impl} backend={a.backend} "
        f"linear_backend={a.linear_backend} linear_conv_backend={a.linear_conv_backend}",
    ]
    if config.model is not None:
        lines.append(f"  model     {_model_line(resolved)}")
    lines += ["", "rank grid (cell = dp.ring.ulysses)", *_grid_lines(m), "", "groups"]
    lines += _group_lines(m)
    warnings = [*notes, *topo_warnings(resolved)]
    lines += ["", "warnings" if warnings else "warnings: none"]
    lines += [f"  - {w}" for w in warnings]
    return "\n".join(lines)


def _model_line(resolved: ResolvedConfig) -> str:
    model, u = resolved.config.model, resolved.ulysses
    rep = resolved.kv_replication
    per_rank_kv = model.num_kv_heads * rep // u
    return (
        f"{model.num_heads} heads / {model.num_kv_heads} KV heads -> per Ulysses rank "
        f"{model.num_heads // u} query head(s) and {per_rank_kv} KV head(s), KV replication x{rep}"
    )


# ----------------------------------------------------------------------------- grid
def _abbreviate(count: int, limit: int, head: int, tail: int) -> list[int | None]:
    """Indices ``0..count-1``, or the first ``head``, None (for "..."), the last ``tail``."""
    if count <= limit:
        return list(range(count))
    return [*range(head), None, *range(count - tail, count)]


def _grid_lines(m: RankMap) -> list[str]:
    columns = _abbreviate(m.ranks_per_node, _MAX_COLUMNS_SHOWN, 8, 4)
    rows = _abbreviate(m.num_nodes, _MAX_NODES_SHOWN, 6, 2)
    cell = max(len(_cell(m, m.world_size - 1)), len(f"local {m.ranks_per_node - 1}"))
    label = len(f"node {m.num_nodes - 1}")
    header = " " * (label + 4) + "  ".join(
        ("..." if c is None else f"local {c}").ljust(cell) for c in columns
    )
    lines = [header.rstrip()]
    for node in rows:
        if node is None:
            lines.append(f"  ... ({m.num_nodes - 8} more nodes)")
            continue
        cells = ("..." if c is None else _cell(m, node * m.ranks_per_node + c) for c in columns)
        lines.append(f"  {f'node {node}'.ljust(label)}  " + "  ".join(x.ljust(cell) for x in cells))
    return [line.rstrip() for line in lines]


def _cell(m: RankMap, rank: int) -> str:
    c = m.coords_of(rank)
    return f"{c.dp}.{c.ring}.{c.ulysses}"


# ----------------------------------------------------------------------------- groups
def _format_group(members: Sequence[int]) -> str:
    """``[0-7]``, ``[0,8,...,56]`` or the full list when short and irregular.

    Groups come from the rank map's lazy accessors: a ``range`` when they are arithmetic
    progressions, so nothing proportional to a group's size is built here.
    """
    if isinstance(members, range) and len(members) >= 3:
        if members.step == 1:
            return f"[{members[0]}-{members[-1]}]"
        return f"[{members[0]},{members[1]},...,{members[-1]}]"
    if len(members) <= 8:
        return "[" + ",".join(map(str, members)) + "]"
    return "[" + ",".join(map(str, members[:6])) + f",... {len(members)} ranks]"


def _group_lines(m: RankMap) -> list[str]:
    lines = []
    u, r, d = m.ulysses_degree, m.ring_degree, m.dp_degree
    for name, count, group in (
        ("ulysses", d * r, m.ulysses_group),
        ("ring", d * u, m.ring_group),
        ("sp", d, m.sp_group),
        ("dp", u * r, m.dp_group),
    ):
        shown = _abbreviate(count, _MAX_GROUPS_SHOWN, 6, 1)
        text = " ".join("..." if i is None else _format_group(group(i)) for i in shown)
        noun = "group" if count == 1 else "groups"
        lines.append(f"  {name:<8} {count} {noun} of {len(group(0))}: {text}")
    if m.ulysses_degree > 1 and m.ring_degree > 1 and m.placement != ULYSSES_IN_NODE:
        lines.append("  (sp groups are listed in sp_rank order = ring * ulysses_degree + ulysses)")
    return lines


# ----------------------------------------------------------------------------- warnings
def topo_warnings(resolved: ResolvedConfig) -> list[str]:
    """Legal but probably unintended choices, one sentence each."""
    return [
        w
        for w in (_cross_node_warning(resolved), _kv_warning(resolved), _node_use_warning(resolved))
        if w
    ]


def _cross_node_warning(resolved: ResolvedConfig) -> str | None:
    m = resolved.rank_map
    crossing = m.cross_node_ulysses_count()
    if not crossing:
        return None
    text = (
        f"{crossing} of {m.dp_degree * m.ring_degree} Ulysses groups span nodes: the all-to-all "
        "(the most bytes per layer) runs over inter-node links"
    )
    if m.ring_degree > 1 and m.ring_groups_inside_nodes():
        text += " while the ring stays inside a node; consider placement ulysses-in-node"
    return text


def _kv_warning(resolved: ResolvedConfig) -> str | None:
    rep, model = resolved.kv_replication, resolved.config.model
    if rep is None or rep == 1:
        return None
    head_dim = model.head_dim or _ASSUMED_HEAD_DIM
    assumed = "" if model.head_dim else " (assumed)"
    before = 2 * model.num_kv_heads * head_dim * _BF16_BYTES  # K and V, bf16
    after = before * rep
    return (
        f"KV heads replicated x{rep} ({model.num_kv_heads} -> {model.num_kv_heads * rep}) so that "
        f"ulysses {resolved.ulysses} splits them: the K/V all-to-all and ring exchange move "
        f"{after} instead of {before} bytes per token per layer (bf16, head_dim {head_dim}{assumed})"
    )


def _node_use_warning(resolved: ResolvedConfig) -> str | None:
    m, model = resolved.rank_map, resolved.config.model
    if m.placement != ULYSSES_IN_NODE or m.ulysses_degree >= m.ranks_per_node:
        return None
    heads = (model.num_heads, model.num_kv_heads) if model else (None, None)
    fits = set(fitting_ulysses_degrees(m.sp_degree, m.ranks_per_node, m.placement, m.world_size))
    better = [
        u for u, _ in valid_degree_pairs(*heads, m.sp_degree) if u > m.ulysses_degree and u in fits
    ]
    if not better:
        return None
    u = max(better)
    return (
        f"ulysses {m.ulysses_degree} uses {m.ulysses_degree} of {m.ranks_per_node} ranks per node; "
        f"ulysses {u} x ring {m.sp_degree // u} would keep more traffic on intra-node links"
    )
