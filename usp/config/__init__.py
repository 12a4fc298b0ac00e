"""usp's config files (TOML): one reader, one set of field validators, one schema.

- :mod:`usp.config.toml`: the bounded TOML reader (:func:`read_toml`), ``AUTO``, how
  values are shown in messages;
- :mod:`usp.config.fields`: the field validators and table reader every section uses,
  overrides derived from the sections' fields;
- :mod:`usp.config.sections`: the topology sections ``[cluster]`` ``[parallel]``
  ``[attention]`` ``[model]`` (head counts);
- :mod:`usp.config.schema`: :class:`UspConfig`, parsing, the file format;
- :mod:`usp.config.resolve`: ``"auto"`` degrees against the rank math and the launch;
- :mod:`usp.config.launch`: :func:`build_topology_from_config` for the running job.

The training sections ``[model]`` (a checkpoint or preset), ``[data]`` and ``[train]``
are read by :mod:`usp.train.config` with the same reader and validators. Every error is
a :class:`ConfigError` naming the file and the ``[section] key``.
"""

from usp.config.fields import (
    apply_overrides,
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_string,
    fail,
    is_int,
    is_number,
    keys_of,
    override_keys,
    read_section,
)
from usp.config.launch import build_topology_from_config, check_topology_matches
from usp.config.resolve import check_cluster_matches_launch
from usp.config.schema import (
    OVERRIDE_KEYS,
    AttentionConfig,
    ClusterConfig,
    ModelConfig,
    ParallelConfig,
    ResolvedConfig,
    UspConfig,
    config_from_dict,
    load_config,
)
from usp.config.toml import AUTO, MAX_CONFIG_BYTES, located, read_toml, toml_repr
from usp.errors import ConfigError
from usp.options import BACKENDS, LAYOUTS, RING_IMPLS

__all__ = [
    "AUTO",
    "BACKENDS",
    "LAYOUTS",
    "MAX_CONFIG_BYTES",
    "OVERRIDE_KEYS",
    "RING_IMPLS",
    "AttentionConfig",
    "ClusterConfig",
    "ConfigError",
    "ModelConfig",
    "ParallelConfig",
    "ResolvedConfig",
    "UspConfig",
    "apply_overrides",
    "build_topology_from_config",
    "check_bool",
    "check_choice",
    "check_cluster_matches_launch",
    "check_int",
    "check_topology_matches",
    "check_number",
    "check_string",
    "config_from_dict",
    "fail",
    "is_int",
    "is_number",
    "keys_of",
    "load_config",
    "located",
    "override_keys",
    "read_section",
    "read_toml",
    "toml_repr",
]
