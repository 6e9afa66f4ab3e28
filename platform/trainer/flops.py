"""The accelerator's peak FLOP/s, the denominator of MFU.

MFU compares the model FLOPs a step did with what the device could do at best, so the peak
must be the dense (not sparsity-doubled) figure for the dtype training runs in. Known GPUs are
matched by name; anything else (a CPU, a new GPU) needs `cluster.peak_tflops` in the config,
or MFU is simply not reported.
"""

from __future__ import annotations

import torch

# bf16 dense peak FLOP/s, matched in order as substrings of torch.cuda.get_device_name()
# (the PCIe H100 first: "H100" alone would match it too).
PEAK_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.4e12),
    ("A100", 312e12),
)


def peak_for(name: str) -> float | None:
    """The table's peak for a device name, or None if it is not in the table."""
    return next((flops for key, flops in PEAK_FLOPS if key.lower() in name.lower()), None)


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """`override_tflops` (from the config) if given, else the table's figure for this GPU."""
    if override_tflops is not None:
        return override_tflops * 1e12
    if device.type == "cuda":
        return peak_for(torch.cuda.get_device_name(device))
    return None
