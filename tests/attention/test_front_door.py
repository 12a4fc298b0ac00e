"""The front door (``import usp``): what it holds, where the rest moved, and the
functional API's ``layout=`` (a Topology's choice; on a Plan only the plan's own)."""

from __future__ import annotations

import importlib

import pytest
import torch
from usp_cases import topology

import usp

FRONT_DOOR = {
    # the plan and USP attention (compile_options: Inductor's, for torch.compile)
    "Plan", "usp_attention", "UspAttention", "compile_options",
    # sharding helpers
    "shard_sequence", "gather_sequence", "local_token_indices", "local_position_ids",
    "sequence_multiple", "pad_documents", "pad_to_multiple", "document_position_ids",
    # config loaders and the topology builder of the README's and docs/'s examples
    "load_config", "build_topology_from_config", "build_topology",
    # errors
    "UspError", "ConfigError", "TopologyError", "InputError", "HeadLayoutError",
    "ShardingError", "PlanError", "RankDisagreementError", "BackendUnavailableError",
    "CheckpointError",
}  # fmt: skip


def test_the_front_door_holds_what_it_says():
    assert set(usp.__all__) == FRONT_DOOR
    for name in FRONT_DOOR:
        assert getattr(usp, name) is not None
    for name in ("UspError", "ConfigError", "TopologyError", "PlanError", "ShardingError"):
        assert issubclass(getattr(usp, name), usp.UspError)


# Names the front door held before 0.1.0 was cut (never released: no tag, no package),
# public in their modules only
IN_THEIR_MODULES = {
    "CommStats": "usp.comm.stats",
    "DocumentPadding": "usp.sp.sharding",
    "PackedSequence": "usp.sp.plan",
    "RankMap": "usp.process_groups",
    "Topology": "usp.process_groups",
    "UspConfig": "usp.config",
    "attention_backward": "usp.kernels",
    "attention_forward": "usp.kernels",
    "ring_attention": "usp.ring",
    "suggest_degrees": "usp.process_groups",
    "valid_degree_pairs": "usp.process_groups",
}


def test_lower_layers_live_in_their_modules_not_the_front_door():
    for name, module in IN_THEIR_MODULES.items():
        assert getattr(importlib.import_module(module), name) is not None
        assert name not in usp.__all__
        with pytest.raises(AttributeError, match=f"module 'usp' has no attribute '{name}'"):
            getattr(usp, name)
    with pytest.raises(AttributeError, match="no attribute 'local_positions'"):
        usp.local_positions  # noqa: B018


def run_functional_layout():
    topo = topology(1, 2)
    full = torch.arange(8.0).reshape(1, 8)
    # a Topology: layout= picks the layout (the caller gives usp_attention the same)
    local = usp.shard_sequence(full, topo, layout="contiguous")
    indices = usp.local_token_indices(8, topo, layout="contiguous")
    same = torch.equal(local[0], full[0, indices])
    back = torch.equal(usp.gather_sequence(local, topo, layout="contiguous"), full)
    plan = usp.Plan(topo, layout="zigzag")
    # a Plan: its own layout may be repeated, another one is refused
    repeated = torch.equal(usp.shard_sequence(full, plan, layout="zigzag"), plan.shard(full))
    errors = []
    for call in (
        lambda: usp.shard_sequence(full, plan, layout="contiguous"),
        lambda: usp.gather_sequence(local, plan, layout="contiguous"),
        lambda: usp.local_position_ids(None, plan, seq_len=8, layout="contiguous"),
    ):
        try:
            call()
        except usp.PlanError as err:
            errors.append(str(err))
    return same, back, repeated, errors, usp.sequence_multiple(plan, layout="contiguous")


def test_functional_layout_on_a_plan_is_the_plans(distributed):
    for same, back, repeated, errors, multiple in distributed.run(
        run_functional_layout, world_size=2
    ):
        assert same and back and repeated
        assert len(errors) == 3
        assert errors[0].startswith(
            "shard_sequence(..., layout='contiguous') on a Plan whose layout is 'zigzag'"
        )
        assert "Build the plan with layout='contiguous'" in errors[0]
        assert multiple == 2  # a question, not a placement: any layout
