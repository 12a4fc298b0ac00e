"""Evaluation of a trained model at long context: ``usp eval``.

- :mod:`usp.evaluation.scoring`: one sharded forward over a sequence, each token scored
  (next-token loss, greedy next token) on the rank that holds it;
- :mod:`usp.evaluation.tasks`: perplexity by position (windows of a held-out token
  stream) and passkey retrieval (a number hidden at a depth of filler text);
- :mod:`usp.evaluation.runner`: which rank scores what, and the sums that make the
  results equal to one process;
- :mod:`usp.evaluation.target`: a training output directory (its newest DCP checkpoint)
  or an HF directory, its tokenizer and the held-out documents;
- :mod:`usp.evaluation.report` and :mod:`usp.evaluation.cli`: ``eval.json``, the table,
  the plots, and the command.

The held-out loss *during* training (``[eval]`` in a training config) is
:mod:`usp.train.evaluate`.
"""

from usp.evaluation.runner import EvalSettings, run_checks
from usp.evaluation.scoring import TokenScores, score_tokens

__all__ = ["EvalSettings", "TokenScores", "run_checks", "score_tokens"]
