"""usp under other training frameworks.

* :mod:`usp.integrations.transformers`: HF transformers' ``Trainer`` and TRL's
  ``SFTTrainer`` on usp's hybrid sequence parallelism (needs ``pip install usp[trainer]``,
  or ``usp[trl]`` for ``UspSFTTrainer``).

Nothing here is imported by ``import usp``.
"""
