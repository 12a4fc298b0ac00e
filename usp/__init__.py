"""usp: hybrid sequence parallelism (Ulysses all-to-all x ring attention) for PyTorch.

Typical use, after ``torch.distributed.init_process_group``::

    plan = usp.Plan(usp.build_topology(ulysses_degree=4, ring_degree=2))
    q, k, v = (plan.shard(t) for t in (q_full, k_full, v_full))
    out = plan.attention(q, k, v, causal=True)
"""

from usp.attention import UspAttention, usp_attention
from usp.comm.agreement import RankDisagreementError
from usp.comm.stats import CommStats
from usp.config import UspConfig, build_topology_from_config, load_config
from usp.errors import ConfigError, InputError, UspError
from usp.functional import (
    gather_sequence,
    local_position_ids,
    local_positions,
    local_token_indices,
    sequence_multiple,
    shard_sequence,
)
from usp.kernels import attention_backward, attention_forward
from usp.plan import PackedSequence, Plan, PlanError
from usp.process_groups import (
    HeadLayoutError,
    RankMap,
    Topology,
    TopologyError,
    build_topology,
    suggest_degrees,
    valid_degree_pairs,
)
from usp.ring import ring_attention
from usp.sharding import (
    DocumentPadding,
    ShardingError,
    document_position_ids,
    pad_documents,
    pad_to_multiple,
)

__version__ = "0.1.0"

__all__ = [
    "CommStats",
    "ConfigError",
    "DocumentPadding",
    "HeadLayoutError",
    "InputError",
    "PackedSequence",
    "Plan",
    "PlanError",
    "RankDisagreementError",
    "RankMap",
    "ShardingError",
    "Topology",
    "TopologyError",
    "UspAttention",
    "UspConfig",
    "UspError",
    "attention_backward",
    "attention_forward",
    "build_topology",
    "build_topology_from_config",
    "document_position_ids",
    "gather_sequence",
    "load_config",
    "local_position_ids",
    "local_positions",
    "local_token_indices",
    "pad_documents",
    "pad_to_multiple",
    "ring_attention",
    "sequence_multiple",
    "shard_sequence",
    "suggest_degrees",
    "usp_attention",
    "valid_degree_pairs",
]
