"""The errors usp raises, under one base (no torch import).

Catch :class:`UspError` for "usp refused this, and the message says what to do";
catch a subclass for one kind. Every class is also a ``ValueError`` (or, for a topology
used after its teardown, a ``RuntimeError``), as the classes of earlier versions were, so
existing ``except ValueError`` code keeps working.

    UspError
    +-- ConfigError              a config file, a command-line flag or an override
    |   +-- DataError            training data that cannot be read, tokenised or packed
    |   +-- ModelConfigError     a model config.json this package cannot compute exactly
    +-- TopologyError            degrees, world size, nodes and placement do not fit
    +-- InputError               the tensors or options of a call cannot be served
    |   +-- HeadLayoutError      head counts that the Ulysses degree cannot split
    |   +-- ShardingError        a sequence that cannot be placed on the ranks as asked
    |   +-- AttentionInputError  (usp.kernels) a local attention call
    |       +-- BackendUnavailableError   a kernel backend that cannot run the call here
    +-- RankDisagreementError    ranks made the same collective call with different arguments
    +-- CheckpointError          a checkpoint that cannot be read, written or resumed from
    +-- TopologyDestroyedError   a topology used after ``destroy()``
    +-- TrainingError            a training run that stopped itself (it diverged)

Modules keep their own narrower subclasses (``PlanError``, ``RingInputError``, ...) where
a caller benefits from telling them apart; each derives from one of these.
"""

from __future__ import annotations


class UspError(Exception):
    """Base of every error usp raises on purpose; the message says what to change."""


class ConfigError(UspError, ValueError):
    """A config file (or its overrides) is malformed or does not fit the world."""


class DataError(ConfigError):
    """Training data that cannot be read, tokenised or packed as asked."""


class MissingDataFile(DataError):
    """A data, held-out or tokenizer file a config names is not on this machine (``usp
    topo`` checks a cluster's config on a laptop: it notes these and goes on)."""


class ModelConfigError(ConfigError):
    """A model configuration this package cannot serve, or an inconsistent one."""


class TopologyError(UspError, ValueError):
    """Degrees, world size, node size and placement do not fit together."""


class InputError(UspError, ValueError):
    """The inputs or options of a call cannot be served as given."""


class HeadLayoutError(InputError):
    """The head counts cannot be split over the requested Ulysses degree."""


class ShardingError(InputError):
    """A sequence cannot be placed on the ranks as asked."""


class AttentionInputError(InputError):
    """The tensors or options of an attention call cannot be served as given."""


class BackendUnavailableError(AttentionInputError):
    """A backend was asked for where it cannot run (device, dtype, option, missing package)."""


class RankDisagreementError(UspError, ValueError):
    """The ranks of a group called a collective operation with different arguments."""


class CheckpointError(UspError, ValueError):
    """A checkpoint (HF directory or training checkpoint) that cannot be used as asked."""


class TopologyDestroyedError(UspError, RuntimeError):
    """A topology's groups or meshes were used after :meth:`Topology.destroy`."""


class TrainingError(UspError, RuntimeError):
    """A training run stopped itself on purpose, on every rank alike (e.g. its loss or
    weights became non-finite); the message says at which step and what to change."""


__all__ = [
    "AttentionInputError",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "HeadLayoutError",
    "InputError",
    "ModelConfigError",
    "RankDisagreementError",
    "ShardingError",
    "TopologyDestroyedError",
    "TopologyError",
    "TrainingError",
    "UspError",
]
