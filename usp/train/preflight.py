"""``usp topo`` on a training config: the ``[train]``/``[data]`` checks ``usp train``
makes before it builds anything, for the degrees ``usp topo`` resolved (no process
group, nothing tokenised)."""

from __future__ import annotations

from types import SimpleNamespace

from usp.config import ConfigError, read_toml
from usp.sharding import required_multiple
from usp.train.config import is_train_config, train_config_from_dict
from usp.train.evaluate import prepare_held_out


def check_training_config(path: str, resolved) -> list[str]:
    """Raise the :class:`~usp.config.ConfigError` ``usp train`` would raise for ``path``
    on ``resolved``'s degrees (``seq_len`` against the layout, the batch arithmetic,
    ``document_multiple``, the data and ``[eval]`` files and the tokenizer); return notes on what could
    not be checked here. A topology-only config returns ``[]``."""
    data = read_toml(path)
    if not is_train_config(data):
        return []
    from usp.train.components import check_lengths, model_source, prepare_data

    job = train_config_from_dict(data, source=path)
    layout = resolved.config.attention.layout
    plan = SimpleNamespace(
        layout=layout,
        ring_degree=resolved.ring,
        ulysses_degree=resolved.ulysses,
        sequence_multiple=required_multiple(resolved.ring, resolved.ulysses, layout),
    )
    document_multiple = check_lengths(job, plan)
    job.gradient_accumulation(resolved.dp)
    try:
        source = model_source(job)
    except ConfigError as err:
        return [f"[data] not checked: the model's config is not readable here ({err})"]
    prepare_held_out(job, prepare_data(job, source, document_multiple))  # [eval] files too
    return []
