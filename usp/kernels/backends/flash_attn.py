"""The flash-attn package (FA2, and FA3 where installed), imported lazily.

(provisional)
"""

from __future__ import annotations

import importlib.util

from usp.kernels.backends.base import Backend


class FlashAttnBackend(Backend):
    name = "flash_attn"
    device_types = ("cuda",)

    def unsupported_reason(self, spec):
        if importlib.util.find_spec("flash_attn") is None:
            return "needs the flash_attn package (pip install 'usp[flash-attn]'), which is not installed"
        return super().unsupported_reason(spec)
