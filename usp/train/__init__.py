"""``usp train``: fine-tune decoder models (usp's nine families: :mod:`usp.models`; HF
models through the plug-in) under USP (FSDP2 over dp x sp).

Parts: :mod:`~usp.train.config` (TOML), :mod:`~usp.train.data` (documents, packing,
batches), :mod:`~usp.train.schedule`, :mod:`~usp.train.parallelize` (FSDP2),
:mod:`~usp.train.checkpoint` (DCP, HF export), :mod:`~usp.train.metrics`,
:mod:`~usp.train.trainer` (the loop, callable in-process) and :mod:`~usp.train.cli`.
Nothing is imported here, so ``import usp`` stays light.
"""
