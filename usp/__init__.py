"""usp: hybrid sequence parallelism (Ulysses all-to-all x ring attention) for PyTorch.

Typical use, after ``torch.distributed.init_process_group``::

    plan = usp.Plan.from_config("examples/configs/cpu_demo.toml")  # or usp.Plan(topology)
    q, k, v = (plan.shard(t) for t in (q_full, k_full, v_full))
    out = plan.attention(q, k, v, causal=True)

The front door holds the plan, USP attention, the sharding helpers, the config loaders
and the errors. Everything else is imported from its module: topologies and degrees
from :mod:`usp.process_groups`, local kernels from :mod:`usp.kernels`, the ring alone
from :mod:`usp.ring`, byte counters from :mod:`usp.comm`, configs from
:mod:`usp.config`, models from :mod:`usp.models`, training from :mod:`usp.train`.
"""

import importlib as _importlib
import importlib.util as _importlib_util

from usp.errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    HeadLayoutError,
    InputError,
    RankDisagreementError,
    ShardingError,
    TopologyError,
    UspError,
)

# The rest of the front door loads on first use (PEP 562): ``import usp`` (and so
# ``usp plan --bad-flag``) costs no torch import; ``usp.Plan`` imports usp.sp.plan then.
_LAZY = {
    "UspAttention": "usp.sp.attention",
    "usp_attention": "usp.sp.attention",
    "build_topology_from_config": "usp.config",
    "compile_options": "usp.comm.overlap",
    "load_config": "usp.config",
    "gather_sequence": "usp.sp.functional",
    "local_position_ids": "usp.sp.functional",
    "local_token_indices": "usp.sp.functional",
    "sequence_multiple": "usp.sp.functional",
    "shard_sequence": "usp.sp.functional",
    "Plan": "usp.sp.plan",
    "PlanError": "usp.sp.plan",
    "build_topology": "usp.process_groups",
    "document_position_ids": "usp.sp.sharding",
    "pad_documents": "usp.sp.sharding",
    "pad_to_multiple": "usp.sp.sharding",
}

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "HeadLayoutError",
    "InputError",
    "Plan",
    "PlanError",
    "RankDisagreementError",
    "ShardingError",
    "TopologyError",
    "UspAttention",
    "UspError",
    "build_topology",
    "build_topology_from_config",
    "compile_options",
    "document_position_ids",
    "gather_sequence",
    "load_config",
    "local_position_ids",
    "local_token_indices",
    "pad_documents",
    "pad_to_multiple",
    "sequence_multiple",
    "shard_sequence",
    "usp_attention",
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # (next time a plain attribute)
        return value
    if _importlib_util.find_spec(f"usp.{name}") is not None:  # a subpackage: usp.models
        return _importlib.import_module(f"usp.{name}")
    raise AttributeError(f"module 'usp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
