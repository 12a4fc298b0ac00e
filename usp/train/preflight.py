"""``usp topo`` on a training config: the ``[train]``/``[data]`` checks ``usp train``
makes before it builds anything, for the degrees ``usp topo`` resolved (no process
group, nothing tokenised)."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

from usp.config import ConfigError, read_toml
from usp.config.overrides import apply_settings, parse_settings
from usp.errors import MissingDataFile
from usp.sp.sharding import required_multiple
from usp.train.components import check_lengths, model_source, prepare_data
from usp.train.config import is_train_config, train_config_from_dict
from usp.train.evaluate import prepare_held_out


def grid_of(resolved) -> SimpleNamespace:
    """What the length checks read of a Plan (``layout``, ``placement``, the degrees,
    ``sequence_multiple``), for a resolved config without building its process groups."""
    layout = resolved.config.attention.layout
    return SimpleNamespace(
        layout=layout,
        placement=resolved.config.parallel.token_placement,
        ring_degree=resolved.ring,
        ulysses_degree=resolved.ulysses,
        sequence_multiple=required_multiple(resolved.ring, resolved.ulysses, layout),
    )


def check_training_config(path: str, resolved, *, sets: Sequence[str] = ()) -> list[str]:
    """Raise the :class:`~usp.config.ConfigError` ``usp train`` would raise for ``path``
    on ``resolved``'s degrees (``seq_len`` against the layout, the batch arithmetic,
    ``document_multiple``, the data and ``[eval]`` files and the tokenizer); return notes on what could
    not be checked here (a model config or a data, held-out or tokenizer file that is not
    on this machine: a cluster's config checked on a laptop). A topology-only config returns ``[]``. ``sets``: ``--set``
    settings, as ``usp train`` applies them."""
    data = apply_settings(read_toml(path), parse_settings(sets))
    if not is_train_config(data):
        return []
    job = train_config_from_dict(data, source=path)
    document_multiple = check_lengths(job, grid_of(resolved))
    job.gradient_accumulation(resolved.dp)
    try:
        source = model_source(job)
    except ConfigError as err:
        return [f"[data] not checked: the model's config is not readable here ({err})"]
    try:
        prepare_held_out(job, prepare_data(job, source, document_multiple))  # [eval] files too
    except MissingDataFile as err:  # a cluster's path, checked on a laptop
        return [f"[data] not checked: a file it names is not on this machine ({err})"]
    return []
