"""usp's benchmarks: scripts (``python benchmarks/X.py`` or ``python -m benchmarks.X``)
and the pieces they share, importable as ``benchmarks.<module>`` from the repository root
(tests do): ``emulate`` (one rank of a large job under the fake process group),
``peer_cases`` / ``collectives`` / ``peer_results`` (the parts of ``peers.py``)."""
