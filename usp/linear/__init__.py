"""Linear token mixers (Gated DeltaNet, Mamba-2) under hybrid sequence parallelism.

- :mod:`usp.linear.kernel`: the gated delta rule in torch (chunked, any dtype) and its
  step-by-step reference;
- :mod:`usp.linear.backends`: the recurrence's kernels behind one seam (torch; fla's
  Triton kernel on CUDA, ``usp[fla]``), their choice and fla's self-check;
- :mod:`usp.linear.conv`: the short conv's kernels (torch's conv1d; causal-conv1d on
  CUDA, ``usp[fla]``), their choice and self-check;
- :mod:`usp.linear.choice`: a layer's kernels, its own or its plan's choice
  (``linear_backend`` / ``linear_conv_backend``), and a forced one refused up front;
- :mod:`usp.linear.ring`: segments of a rank's ring block and the ring scan of states;
- :mod:`usp.linear.block`: a rank's ring block through the conv and the recurrence;
- :mod:`usp.linear.compiled`: that block as one ``torch.library`` op, for ``torch.compile``;
- :mod:`usp.linear.gdn`: :func:`gated_deltanet_usp`, the conv + recurrence under a Plan;
- :mod:`usp.linear.module`: :class:`GatedDeltaNet`, transformers' Qwen3.5 GDN layer;
- Mamba-2 (SSD) on the same ring design: :mod:`usp.linear.scan` (the scalar-decay scan in
  torch), :mod:`usp.linear.scan_backends` (its kernels: torch, fla's simple GLA),
  :mod:`usp.linear.ssd` (a rank's ring block), :mod:`usp.linear.mamba2`
  (:func:`mamba2_usp`), :mod:`usp.linear.mamba2_module` (:class:`Mamba2Mixer`, the layer
  of transformers' Mamba-2 hybrids);
- shared by the mixers: :mod:`usp.linear.heads` (documents, all-to-all by dtype, each
  rank's channels), :mod:`usp.linear.fla_rows` (padded rows as one packed fla call).
"""

from usp.linear.gdn import LinearAttentionError, gated_deltanet_usp
from usp.linear.mamba2 import Mamba2Error, mamba2_usp
from usp.linear.mamba2_module import Mamba2Mixer
from usp.linear.module import GatedDeltaNet

__all__ = [
    "GatedDeltaNet", "LinearAttentionError", "Mamba2Error", "Mamba2Mixer", "gated_deltanet_usp",
    "mamba2_usp",
]  # fmt: skip
