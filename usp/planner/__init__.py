"""``usp plan``: how long a sequence fits, from one rank's real training step measured
under fake tensors (:mod:`usp.planner.measure`), a search over grids and memory options
(:mod:`usp.planner.search`) and what is printed (:mod:`usp.planner.report`)."""
