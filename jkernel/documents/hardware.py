"""Chip, fabric and storage-class documents (spec documents.md §3–§5)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._strict import Reader, read_yaml_file, refuse

__all__ = ["Chip", "Fabric", "StorageClass", "load_chip", "load_fabric", "load_storage",
           "parse_chip", "parse_fabric", "parse_storage"]

_PROVENANCE = ("vendor_spec", "derived")


@dataclass(frozen=True)
class Chip:
    """One accelerator's vendor figures. Rates are dense; NVLink is per GPU, per direction."""

    name: str
    provenance: str
    bf16_peak_tflops: float
    fp8_peak_tflops: float          # 0: no native FP8
    nvfp4_peak_tflops: float        # > 0 identifies data-centre Blackwell (SM100)
    hbm_tbs: float
    memory_gib: float
    nvlink_gbps: float
    sm_count: int
    gpus_per_node: int = 0
    gpus_per_rack: int = 0
    intra_rack_gbps: float = 0.0
    reported_memory_gib: float = 0.0   # what CUDA reports as total (torch.cuda.mem_get_info)

    @property
    def memory_bytes(self) -> float:
        """HBM capacity in bytes, ``MemoryGiB·2³⁰`` as a float."""
        return self.memory_gib * 2.0 ** 30

    @property
    def rack_domain(self) -> bool:
        """The rack is one NVLink domain (GB200/GB300 NVL72)."""
        return self.gpus_per_rack > 0 and self.intra_rack_gbps > 0

    @property
    def blackwell(self) -> bool:
        return self.nvfp4_peak_tflops > 0

    @property
    def pre_hopper(self) -> bool:
        """Decision D13: decided by name (``a100*``, ``l40*``)."""
        return self.name.startswith("a100") or self.name.startswith("l40")

    @property
    def is_a100(self) -> bool:
        return self.name.startswith("a100")


@dataclass(frozen=True)
class Fabric:
    name: str
    provenance: str
    inter_node_gbps: float          # per GPU, per direction
    rdma: bool | None = None


@dataclass(frozen=True)
class StorageClass:
    name: str
    read_mb_s: float
    write_mb_s: float
    base_latency_us: float


def parse_chip(data: Any, name: str, file: str | None = None) -> Chip:
    r = Reader(data, file, comments=True)
    prov = r.str("Provenance", required=True, choices=_PROVENANCE)
    bf16 = r.num("TFlopsPeak", required=True, positive=True)
    fp8 = r.num("TFlopsFP8", 0.0, minimum=0.0)
    fp4 = r.num("TFlopsNVFP4", 0.0, minimum=0.0)
    hbm = r.num("BwPeakTBs", required=True, positive=True)
    mem = r.num("MemoryGiB", required=True, positive=True)
    nvl = r.num("IntraNodeBwGBps", required=True, positive=True)
    sms = r.int("SMCount", required=True, minimum=1, limit="MAX_WIDTH")
    gpn = r.int("GPUsPerNode", 0, minimum=1, limit="MAX_GPUS_PER_NODE")
    gpr = r.int("GPUsPerRack", 0, minimum=1, limit="MAX_GPUS_PER_NODE")
    rack_bw = r.num("IntraRackBwGBps", 0.0, positive=True)
    reported = r.num("ReportedMemoryGiB", 0.0, positive=True)
    r.done()
    if fp8 and fp8 <= bf16:
        raise refuse(f"TFlopsFP8 {fp8} must exceed TFlopsPeak {bf16} (0 or absent means no "
                     "native FP8)", file=file, field="TFlopsFP8")
    if gpr and gpn and gpr % gpn:
        raise refuse(f"GPUsPerRack {gpr} must be a multiple of GPUsPerNode {gpn}", file=file,
                     field="GPUsPerRack")
    if rack_bw and not gpr:
        raise refuse("IntraRackBwGBps needs GPUsPerRack", file=file, field="IntraRackBwGBps")
    if reported > mem:
        raise refuse(f"ReportedMemoryGiB {reported} exceeds MemoryGiB {mem}: the device "
                     "reports at most its capacity", file=file, field="ReportedMemoryGiB")
    return Chip(name, prov, bf16, fp8, fp4, hbm, mem, nvl, sms, gpn, gpr, rack_bw, reported)


def parse_fabric(data: Any, name: str, file: str | None = None) -> Fabric:
    r = Reader(data, file, comments=True)
    prov = r.str("Provenance", required=True, choices=_PROVENANCE)
    bw = r.num("InterNodeBwGBps", required=True, positive=True)
    rdma = r.bool("RDMA", None)
    r.done()
    return Fabric(name, prov, bw, rdma)


_STORAGE_KEYS = (("read_bandwidth_mb_s", "read_bandwidth"),
                 ("write_bandwidth_mb_s", "write_bandwidth"),
                 ("base_latency_us", "base_latency"))


def parse_storage(data: Any, file: str | None = None) -> dict[str, StorageClass]:
    """The storage file: a map from class name to figures; either key spelling (D21)."""
    top = Reader(data, file, comments=True)
    out: dict[str, StorageClass] = {}
    for name in list(top.data):
        if name in top.used:
            continue
        sub = top.sub(name, required=True, comments=True)
        values = []
        for new, old in _STORAGE_KEYS:
            if sub.has(new) and sub.has(old):
                raise sub.error(new, f"states both {new!r} and its older spelling {old!r}; "
                                "state one")
            key = new if sub.has(new) else old
            if not sub.has(key):
                raise sub.error(new, f"required key is missing (or its older spelling {old!r})")
            values.append(sub.num(key, required=True, positive=True))
            sub.allowed.extend([new, old])
        sub.done()
        out[name] = StorageClass(name, *values)
    top.done()
    return out


def load_chip(path: Path | str) -> Chip:
    data, file = read_yaml_file(path, what="chip document")
    return parse_chip(data, Path(path).stem, file)


def load_fabric(path: Path | str) -> Fabric:
    data, file = read_yaml_file(path, what="fabric document")
    return parse_fabric(data, Path(path).stem, file)


def load_storage(path: Path | str) -> dict[str, StorageClass]:
    data, file = read_yaml_file(path, what="storage file")
    return parse_storage(data, file)
