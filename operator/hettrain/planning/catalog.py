"""Device catalog: public peak specs of the accelerators hettrain plans for.

Numbers are vendor datasheet values for dense (non-sparse) BF16 math:
- NVIDIA H100 SXM5: 989 TFLOP/s, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s bidirectional
  (450 GB/s per direction). H200: same compute, 141 GB HBM3e at 4.8 TB/s.
  A100 80GB SXM: 312 TFLOP/s, 2.04 TB/s, NVLink 3 600 GB/s (300 per direction).
  L40S: 362 TFLOP/s dense BF16, 48 GB GDDR6 at 864 GB/s, PCIe Gen4 x16 (~32 GB/s).
- AMD Instinct MI300X: 1307 TFLOP/s, 192 GB HBM3 at 5.3 TB/s, 7 Infinity Fabric links of
  64 GB/s (448 GB/s). MI250X: 383 TFLOP/s, 128 GB HBM2e at 3.2 TB/s, 8 IF links (~400 GB/s).
- Intel Gaudi 2: ~432 TFLOP/s BF16 (MME), 96 GB HBM2e at 2.46 TB/s, 21x100 GbE scale-up
  (~262 GB/s). Gaudi 3: 1835 TFLOP/s, 128 GB HBM2e at 3.7 TB/s, 21x200 GbE (~525 GB/s).
- Huawei Ascend 910B: ~320 TFLOP/s FP16/BF16, 64 GB HBM2e at 1.6 TB/s, HCCS 392 GB/s.

Achievable efficiency is never the peak: ``efficiency`` is the fraction of peak a large,
well-shaped GEMM reaches on the device (the asymptote of the time model's saturating GEMM curve;
attention, memory-bound operators and kernel overheads are costed on top, ``cost.py``). It is
explicit and overridable per cluster. A100-80GB's 0.68 is FITTED to Megatron-LM SC'21 Table 1
(``bench/fit_time_model.py``); the other devices' values are estimates not yet checked against
published runs.
Unknown devices must be declared in the cluster YAML ``devices:``; they are never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hettrain.api.constants import VENDORS
from hettrain.planning import fields
from hettrain.planning.errors import PlanningInputError

# fraction of the FP32 peak an fp32 layer reaches: fitted to an H200's fp32 forward+backward of
# a two-layer Llama-3-8B stage at 8k tokens (1.06 s; bench/gpu_check.py, docs/planning.md)
FP32_EFFICIENCY = 0.85
# Hopper runs the runtime's SDPA as causal flash attention: half the pairs the cost model
# counts, at about the GEMMs' efficiency, so 2x their rate on the full count. Fitted to an
# H200's two-layer Llama-3-8B stage at 4k and 8k tokens (bench/gpu_check.py, docs/runtime.md);
# the H100 has the same SMs and clocks
HOPPER_FLASH_ATTENTION_EFFICIENCY = 2.0
# bf16 / fp32 matrix rate assumed where the datasheet gives no FP32 number (Gaudi, Ascend):
# the TF32-class ratio of matrix units; an assumption, not a measurement
FP32_FALLBACK_RATIO = 4.0


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator model's public specs (dense BF16)."""

    name: str
    vendor: str
    bf16_tflops: float
    hbm_gib: float
    hbm_tbps: float
    intra_node_gbps: float  # GB/s per GPU, per direction, inside a node
    backend: str  # torch.distributed backend inside a pool: nccl (CUDA and ROCm), hccl, gloo
    efficiency: float = 0.45  # fraction of peak a large GEMM reaches (time-model asymptote)
    pcie_gbps: float = 25.0  # GB/s device<->host for host-staged transfers
    profile: Any = None  # planning.profiles.LayerProfile: measured layer costs (hettrain profile)
    # FP32 matrix rate for fp32 plans (the runtime leaves TF32 off): the datasheet's FP32
    # (NVIDIA: CUDA cores; AMD: FP32 matrix); 0 = unpublished, bf16 / FP32_FALLBACK_RATIO
    fp32_tflops: float = 0.0
    fp32_efficiency: float = FP32_EFFICIENCY
    # the attention core's rate relative to the GEMMs', on the cost model's full s² pair count;
    # 0: cost.ATTENTION_EFFICIENCY (fitted to Megatron's 2021 kernels, which score every pair)
    attention_efficiency: float = 0.0

    @property
    def flops(self) -> float:
        """Peak dense BF16 FLOP/s."""
        return self.bf16_tflops * 1e12

    @property
    def effective_flops(self) -> float:
        """FLOP/s the cost model assumes (peak times efficiency)."""
        return self.flops * self.efficiency

    def matmul_flops(self, elem_bytes: int = 2) -> float:
        """FLOP/s the cost model assumes for matrix work in a precision of ``elem_bytes``:
        bf16/fp16 (2) the dense BF16 peak times ``efficiency``; fp32 (4) the FP32 peak times
        ``fp32_efficiency`` (an fp32 plan is 7.9x slower than bf16 on an H200, measured by
        ``bench/gpu_check.py``, not the same speed)."""
        if elem_bytes != 4:
            return self.effective_flops
        return self.peak_matmul_flops(4) * self.fp32_efficiency

    def peak_matmul_flops(self, elem_bytes: int = 2) -> float:
        """Peak matrix FLOP/s in a precision of ``elem_bytes`` (MFU's denominator): the dense
        BF16 peak, or for fp32 the FP32 one (``bf16 / FP32_FALLBACK_RATIO`` if unpublished)."""
        if elem_bytes != 4:
            return self.flops
        return (self.fp32_tflops or self.bf16_tflops / FP32_FALLBACK_RATIO) * 1e12

    @property
    def hbm_bytes(self) -> float:
        """Device memory in bytes."""
        return self.hbm_gib * 2**30


_GB = 1000**3 / 2**30  # GB (datasheet) -> GiB

CATALOG: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("H100-SXM", "nvidia", 989, 80 * _GB, 3.35, 450, "nccl", 0.45, 55,
                   fp32_tflops=67, attention_efficiency=HOPPER_FLASH_ATTENTION_EFFICIENCY),
        DeviceSpec("H200", "nvidia", 989, 141 * _GB, 4.8, 450, "nccl", 0.47, 55, fp32_tflops=67,
                   attention_efficiency=HOPPER_FLASH_ATTENTION_EFFICIENCY),
        DeviceSpec("A100-80GB", "nvidia", 312, 80 * _GB, 2.04, 300, "nccl", 0.68, 25,
                   fp32_tflops=19.5),
        DeviceSpec("L40S", "nvidia", 362, 48 * _GB, 0.864, 32, "nccl", 0.40, 25, fp32_tflops=91.6),
        DeviceSpec("MI300X", "amd", 1307, 192 * _GB, 5.3, 448, "nccl", 0.35, 55,
                   fp32_tflops=163.4),
        DeviceSpec("MI250X", "amd", 383, 128 * _GB, 3.2, 400, "nccl", 0.35, 25, fp32_tflops=95.7),
        DeviceSpec("Gaudi2", "intel", 432, 96 * _GB, 2.46, 262, "hccl", 0.40, 25),
        DeviceSpec("Gaudi3", "intel", 1835, 128 * _GB, 3.7, 525, "hccl", 0.35, 55),
        DeviceSpec("Ascend-910B", "huawei", 320, 64 * _GB, 1.6, 392, "hccl", 0.40, 25),
        # A pseudo-device for CPU demos and tests (gloo); tiny numbers, never a real plan target.
        DeviceSpec("CPU", "cpu", 1.0, 16, 0.05, 5, "gloo", 0.5, 5, fp32_tflops=1.0,
                   fp32_efficiency=0.5),
    )
}

_REQUIRED = ("vendor", "bf16Tflops", "hbmGiB", "hbmTBps", "intraNodeGBps", "backend")


BACKENDS = ("nccl", "hccl", "gloo")
DEVICE_VENDORS = (*VENDORS, "cpu")


def device_from_yaml(doc: Mapping[str, Any], where: str) -> DeviceSpec:
    """A user-declared device from a cluster YAML ``devices:`` entry (camelCase).

    Every number must be finite and positive (efficiency in (0, 1]): a zero TFLOP/s or
    bandwidth would divide by zero in the cost model, an efficiency above 1 would predict an
    MFU above 100%.
    """
    name = fields.name(doc.get("name"), f"{where}.name")
    missing = [k for k in _REQUIRED if k not in doc]
    if missing:
        raise PlanningInputError(
            f"{where}.{missing[0]}", f"is required for device {name!r}; give {', '.join(_REQUIRED)}"
        )
    known = {*_REQUIRED, "name", "efficiency", "pcieGBps", "fp32Tflops"}
    unknown = sorted(str(k) for k in doc if k not in known)
    if unknown:
        raise PlanningInputError(f"{where}.{unknown[0]}",
                                 f"unknown field; allowed: {', '.join(sorted(known))}")
    return DeviceSpec(
        name=name,
        vendor=fields.choice(doc["vendor"], f"{where}.vendor", DEVICE_VENDORS),
        bf16_tflops=fields.number(doc["bf16Tflops"], f"{where}.bf16Tflops", fields.TFLOPS,
                                  "TFLOP/s"),
        hbm_gib=fields.number(doc["hbmGiB"], f"{where}.hbmGiB", fields.HBM_GIB, "GiB"),
        hbm_tbps=fields.number(doc["hbmTBps"], f"{where}.hbmTBps", fields.HBM_TBPS, "TB/s"),
        intra_node_gbps=fields.number(doc["intraNodeGBps"], f"{where}.intraNodeGBps",
                                      fields.INTRA_NODE_GBPS, "GB/s"),
        backend=fields.choice(doc["backend"], f"{where}.backend", BACKENDS),
        efficiency=fields.number(doc.get("efficiency", 0.45), f"{where}.efficiency",
                                 fields.EFFICIENCY),
        pcie_gbps=fields.number(doc.get("pcieGBps", 25.0), f"{where}.pcieGBps",
                                fields.PCIE_GBPS, "GB/s"),
        fp32_tflops=(fields.number(doc["fp32Tflops"], f"{where}.fp32Tflops", fields.TFLOPS,
                                   "TFLOP/s") if "fp32Tflops" in doc else 0.0),
    )


def resolve_device(name: str, devices: Mapping[str, DeviceSpec], where: str) -> DeviceSpec:
    """Look a device up in user devices first, then the catalog; unknown is an error."""
    if name in devices:
        return devices[name]
    if name in CATALOG:
        return CATALOG[name]
    raise PlanningInputError(
        where,
        f"device {name!r} is not in the catalog ({', '.join(CATALOG)}); declare it under "
        "devices: with name, vendor, bf16Tflops, hbmGiB, hbmTBps, intraNodeGBps, backend",
    )
