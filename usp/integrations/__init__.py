"""usp under other training frameworks.

* :mod:`usp.integrations.transformers`: HF transformers' ``Trainer`` and TRL's
  ``SFTTrainer``, ``GRPOTrainer`` and ``DPOTrainer`` on usp's hybrid sequence parallelism
  (needs ``pip install usp[trainer]``, or ``usp[trl]`` for the TRL trainers:
  :mod:`usp.integrations.hf_trl`, :mod:`usp.integrations.trl_grpo`,
  :mod:`usp.integrations.trl_dpo`).

Nothing here is imported by ``import usp``.
"""
