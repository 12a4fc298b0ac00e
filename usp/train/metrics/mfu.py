"""The model FLOPs utilisation estimate: the device's dense bf16 peak (a known
accelerator's vendor figure, or ``[train] peak_tflops``)."""

from __future__ import annotations

import torch

# Dense bf16 tensor-core peak per device, for the MFU estimate (vendor figures, TFLOP/s).
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0}


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a known accelerator, else None (no MFU shown)."""
    for key, value in _PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def device_peak_tflops(job, device) -> float | None:
    if job.train.peak_tflops != "auto":
        return float(job.train.peak_tflops)
    if device.type != "cuda":
        return None
    return peak_tflops(torch.cuda.get_device_name(device))
