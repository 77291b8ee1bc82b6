"""The device table the step-time model reads: peak dense bf16 FLOP/s, memory, bandwidths.

Vendor datasheet figures (SXM parts, dense, no sparsity); ``gemm_efficiency`` is the share of
peak that large bf16 GEMMs reach in practice (an assumption, stated in docs/planning.md, the
same for every model; not fitted to any MFU table). Every field can be overridden from the
command line (``megadlms-plan --device H100 --device-field hbm_gb=94``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Sequence

__all__ = ["DEVICES", "Device", "device_from"]


@dataclass(frozen=True)
class Device:
    """One accelerator and its interconnect, per GPU."""

    name: str
    peak_tflops: float  # dense bf16 tensor-core peak, TFLOP/s
    hbm_gb: float  # memory, 1e9 bytes
    hbm_tbps: float  # memory bandwidth, TB/s (reported; the step model is compute + communication)
    nvlink_gbps: float  # intra-node bandwidth per GPU and direction, GB/s
    ib_gbps: float  # inter-node bandwidth per GPU and direction, GB/s
    gpus_per_node: int = 8
    gemm_efficiency: float = 0.75  # achieved / peak for large bf16 GEMMs (assumption)


DEVICES: Dict[str, Device] = {
    "A100": Device("A100", peak_tflops=312, hbm_gb=80, hbm_tbps=2.04, nvlink_gbps=300, ib_gbps=25),
    "H100": Device("H100", peak_tflops=989, hbm_gb=80, hbm_tbps=3.35, nvlink_gbps=450, ib_gbps=50),
    "H200": Device("H200", peak_tflops=989, hbm_gb=141, hbm_tbps=4.8, nvlink_gbps=450, ib_gbps=50),
    "B200": Device("B200", peak_tflops=2250, hbm_gb=180, hbm_tbps=8.0, nvlink_gbps=900, ib_gbps=50),
}


def device_from(name: str, overrides: Sequence[str] = ()) -> Device:
    """The table's ``name`` with ``field=value`` overrides; ValueError naming the bad one."""
    if name not in DEVICES:
        raise ValueError(f"--device {name}: not in the device table; use one of {', '.join(DEVICES)}")
    dev = DEVICES[name]
    fields = {f.name: f.type for f in dataclasses.fields(Device) if f.name != "name"}
    changes: Dict[str, Any] = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in fields or not value:
            raise ValueError(f"--device-field {item}: use FIELD=VALUE with FIELD one of {', '.join(fields)}")
        try:
            changes[key] = int(value) if key == "gpus_per_node" else float(value)
        except ValueError:
            raise ValueError(f"--device-field {item}: {value!r} is not a number") from None
    return dataclasses.replace(dev, **changes)
