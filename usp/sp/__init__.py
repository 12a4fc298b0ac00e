"""The sequence-parallel core: one hybrid attention call, Ulysses × ring.

``plan`` (the validated grid, layout and backend a model's attention calls share),
``attend`` (one call: Ulysses all-to-all, then the ring, then back), ``attention`` (the
``nn.Module`` and ``usp_attention``), ``ulysses`` (the head all-to-all), ``sharding`` and
``packing`` (how a batch's tokens and documents land on ranks), ``functional`` (sharding
helpers for user code).

Below it: ``usp.options`` and ``usp.errors`` (names and errors every layer shares),
``usp.comm``, ``usp.kernels``, ``usp.ring``, ``usp.process_groups``; above it: ``usp.linear``,
``usp.models``, ``usp.train``, ``usp.planner``, ``usp.integrations``.
"""
