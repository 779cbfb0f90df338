"""Seed fit of the collective coefficients from NVIDIA's NCCL sweeps.

Writes ``cost-model-collectives.yaml``: for every chip, op and width, the three coefficients of
the collective law ``jkernel.laws.collective_time`` (spec step.md §2)::

    collective_floor_<op>_fp16_<N>rank_<chip>            µs        (us_per_transfer)
    collective_peak_rate_<op>_fp16_<N>rank_<chip>        bytes/µs  (bytes_per_us)
    collective_transition_rate_<op>_fp16_<N>rank_<chip>  bytes/µs  (bytes_per_us)

Usage::

    python -m jkernel.calibration.seed --data /work/shared/data/aic-op-profiles \\
        --out catalog/coefficients

The numerical core (the grid-search fit of one collective law, the 16-rank rule) lives in
:mod:`jkernel.calibration.fit.collectives`, where ``python -m jkernel.calibration profiles``
uses it as its starting point; this module keeps the seed's reader, entry builder and
command line, which wrote the catalog's first collectives.

Where the numbers come from:

* **Measured** (method ``measured``): each ``<dir>/comm/nccl/<ver>/nccl_perf.parquet`` of
  NVIDIA's AIConfigurator data. Rows with ``nccl_dtype == "half"`` are used. ``latency`` is
  milliseconds per call. ``message_size`` counts **elements**, so a half row carries
  ``2 · message_size`` bytes. All-reduce is fitted on the NCCL table and not on vLLM's custom
  all-reduce table, because the spec prices every all-reduce with one key whichever backend
  runs it.
* **Fit**: minimise the mean absolute log ratio between the law and the measured latencies,
  over ``log`` of the three parameters, by a deterministic grid search that zooms in
  (:func:`fit_collective`). If the peak rate binds at no measured point, or saves less than
  0.001 of mean absolute log error, the data does not identify it. It is then recorded as
  ``max(transition, best measured throughput)``, a value that binds nowhere.
* **16 ranks** (method ``assumed``): no sweep is wider than 8 ranks. :func:`extrapolate_16`
  continues the 4→8 floor growth for one more doubling, and scales both 8-rank rates by
  14/15, which is NCCL's ring bus-bandwidth correction from 8 to 16 ranks.
* **Chips without a sweep** (:data:`DERIVED`): gb200-nvl72 copies b200 and gb300 copies b300.
  Each pair has the same GPU die and the same 900 GB/s NVLink 5, and the NVL72 switch keeps
  these widths on NVLink. a100-80 copies a100-sxm, of which it is an alias. l40s has no sweep
  in the data: it takes a100-sxm's fits, with both rates scaled by the link ratio
  32/300 (PCIe Gen4 against NVLink 3) and the floors kept (method ``assumed``). If a sweep for
  l40s appears in the data, it is fitted like the others.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import numpy as np

from jkernel.atomic import write_text

from .data.profiles import CATALOG_NAMES
from .fit.collectives import (Fit, extrapolate_16, fit_collective, geometric_error, rounded,
                              scale_rates, written)
from .report.coefficients import catalog_yaml

__all__ = ["DERIVED", "OPS", "read_nccl_sweeps", "fit_chip", "build_entries", "write_set",
           "main"]

#: Chips without a sweep: catalog name → (source chip, rate factor, method, reason).
DERIVED = {
    "gb200-nvl72": ("b200", 1.0, "copied",
                    "GB200 uses the B200's GB100 die and NVLink 5 at 900 GB/s per GPU. The NVL72 "
                    "switch keeps a group of up to 72 GPUs on NVLink, so b200's 8-GPU sweeps stand "
                    "in for it."),
    "gb300": ("b300", 1.0, "copied",
              "GB300 uses the B300's Blackwell Ultra die and NVLink 5 at 900 GB/s per GPU. The "
              "NVL72 switch keeps a group of up to 72 GPUs on NVLink, so b300's 8-GPU sweeps "
              "stand in for it."),
    "a100-80": ("a100-sxm", 1.0, "copied",
                "a100-80 is an alias of a100-sxm (the same A100 SXM4 80 GB part)."),
    "l40s": ("a100-sxm", 32.0 / 300.0, "assumed",
             "No L40S NCCL sweep exists in the data. L40S has no NVLink: its GPUs talk over PCIe "
             "Gen4 at 32 GB/s per direction. The values are a100-sxm's fitted law (NVLink 3, "
             "300 GB/s) with both rates scaled by 32/300, the ratio of the two links' "
             "IntraNodeBwGBps. The floors are kept, on the assumption that NCCL's per-call "
             "protocol cost does not depend on the link. Replace with a measured sweep."),
}

OPS = ("all_reduce", "all_gather", "reduce_scatter", "alltoall")
HALF_BYTES = 2          # bytes per element of a "half" NCCL row
# --------------------------------------------------------------------------- data


def read_nccl_sweeps(path: Path, bytes_per_element: float = HALF_BYTES):
    """``{(op, N): (nbytes, seconds)}`` from one ``nccl_perf.parquet``, half rows only.

    ``bytes_per_element`` is 2 for the table's real unit. Pass 1 to read ``message_size`` as
    bytes, which is how the reference registry read it (see :func:`main`).
    """
    import pyarrow.parquet as pq

    cols = pq.read_table(path, columns=["op_name", "nccl_dtype", "num_gpus", "message_size",
                                        "latency"]).to_pydict()
    out: dict[tuple[str, int], tuple[list, list]] = {}
    for op, dt, n, size, ms in zip(cols["op_name"], cols["nccl_dtype"], cols["num_gpus"],
                                   cols["message_size"], cols["latency"]):
        if dt != "half" or op not in OPS or not (size and ms and ms > 0):
            continue
        b, t = out.setdefault((op, int(n)), ([], []))
        b.append(float(size) * bytes_per_element)
        t.append(float(ms) * 1e-3)
    return {k: (np.asarray(b), np.asarray(t)) for k, (b, t) in sorted(out.items())}


# --------------------------------------------------------------------------- fitting


def fit_chip(data: Path, profile_dir: str, bytes_per_element: float = HALF_BYTES):
    """``{(op, N): Fit}`` for every half sweep of one profile directory. Returns ``{}`` when the
    directory has no NCCL table. The newest version directory wins."""
    tables = sorted((data / profile_dir / "comm" / "nccl").glob("*/nccl_perf.parquet"))
    if not tables:
        return {}
    path = tables[-1]
    rel = path.relative_to(data.parent) if data.parent in path.parents else path
    fits = {}
    for key, (b, t) in read_nccl_sweeps(path, bytes_per_element).items():
        fits[key] = replace(fit_collective(b, t), source=str(rel))
    return fits


# --------------------------------------------------------------------------- entries


def _stem(op: str, n: int, chip: str) -> str:
    return f"{op}_fp16_{n}rank_{chip.replace('-', '_')}"


def _entry_triple(chip, op, n, fit: Fit, method, rationale, sources=None, copied_from=None):
    """The three registry entries (floor, peak, transition) for one key."""
    floor_us, peak, trans = written(fit)
    common = {"method": method, "fitted": method == "measured", "scope": {"hardware": [chip]}}
    if sources:
        common["sources"] = sources
    if copied_from:
        common["copied_from"] = copied_from
    common["rationale"] = rationale
    values = (("collective_floor_", floor_us, "us_per_transfer"),
              ("collective_peak_rate_", peak, "bytes_per_us"),
              ("collective_transition_rate_", trans, "bytes_per_us"))
    return [{prefix + _stem(op, n, chip): {"value": v, "units": u, **common}}
            for prefix, v, u in values]


def _measured_rationale(op, fit: Fit) -> str:
    table = ("NCCL table (not vLLM's custom all-reduce table; the spec prices every all-reduce "
             "with this one key)" if op == "all_reduce" else "NCCL table")
    return (f"Fitted by jkernel/calibration/seed.py on the {fit.rows} half-precision rows of the "
            f"{table}. message_size is read as elements × 2 B. The fit minimises the mean "
            f"absolute log ratio. Geometric error {fit.geo_error:.3f}x.")


def build_entries(fits_by_chip: dict[str, dict]):
    """Registry entries for every chip: measured widths, the 16-rank extrapolation, then the
    derived chips. ``fits_by_chip`` maps catalog chip → ``{(op, N): Fit}`` of measured fits."""
    entries, table = [], {}
    for chip, fits in fits_by_chip.items():
        table[chip] = dict(fits)
        for op in OPS:
            widths = sorted(n for (o, n) in fits if o == op)
            for n in widths:
                f = fits[(op, n)]
                src = [{"kind": "model",
                        "cite": f"NVIDIA AIConfigurator {f.source}: op_name {op}, nccl_dtype half, "
                                f"num_gpus {n}, {f.rows} rows",
                        "role": "primary"}]
                entries += _entry_triple(chip, op, n, f, "measured", _measured_rationale(op, f),
                                         src)
            if 4 in widths and 8 in widths:
                f16 = extrapolate_16(fits[(op, 4)], fits[(op, 8)])
                table[chip][(op, 16)] = f16
                g = fits[(op, 8)].floor_s / fits[(op, 4)].floor_s
                entries += _entry_triple(
                    chip, op, 16, f16, "assumed",
                    f"No sweep is wider than 8 ranks. The floor continues the measured 4→8 growth "
                    f"for one more doubling (×{max(g, 1.0):.3f}). Both rates are the 8-rank fit × "
                    f"14/15, NCCL's ring bus-bandwidth correction from 8 to 16 ranks. A group this "
                    f"wide usually spans nodes, and the kernel prices that crossing with its span "
                    f"multiplier, so this law describes the NVLink part only.",
                    [{"kind": "model",
                      "cite": f"NVIDIA AIConfigurator {fits[(op, 8)].source}: the 4- and 8-rank "
                              f"{op} half rows this extrapolates",
                      "role": "supporting"}])
    for chip, (src_chip, factor, method, reason) in DERIVED.items():
        if chip in fits_by_chip or src_chip not in table:
            continue
        table[chip] = {}
        for (op, n), f in sorted(table[src_chip].items()):
            g = (replace(f, source=f"copied from {src_chip}") if factor == 1.0
                 else scale_rates(f, factor, f"{src_chip} × {factor:.4f}"))
            table[chip][(op, n)] = g
            why = (f"{reason} Values are {src_chip}'s {n}-rank {op} entries"
                   + ("" if factor == 1.0 else f" with both rates × {factor:.4f}") + "."
                   + (" That 16-rank entry is itself an extrapolation." if n == 16 else ""))
            entries += _entry_triple(chip, op, n, g, method, why,
                                     copied_from=f"hardware: [{src_chip}]" if method == "copied"
                                     else None)
    return entries, table


# --------------------------------------------------------------------------- output



HEADER = """\
# cost-model-collectives: the three-parameter collective law per op, width and chip.
#
# GENERATED by `python -m jkernel.calibration.seed --data <aic-op-profiles> --out catalog/coefficients`.
# Do not edit by hand; re-run the seed (or, later, `python -m jkernel.calibration profiles`).
#
#   coll_t(b) = max(floor + b / transition_rate, b / peak_rate)      (spec step.md §2)
#
# Measured entries are fitted to NVIDIA AIConfigurator NCCL sweeps (half precision; message_size
# is in elements, 2 bytes each). 16-rank entries are extrapolated (assumed). gb200-nvl72, gb300,
# a100-80 and l40s have no sweep and are derived (copied / assumed); each entry's rationale says
# how. See catalog/README.md.
"""


def write_set(entries, path: Path) -> None:
    doc = {"kind": "CoefficientSet", "name": "cost-model-collectives", "coefficients": entries}
    text = catalog_yaml(doc)
    write_text(path, HEADER + text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jkernel.calibration.seed",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, required=True, help="the aic-op-profiles directory")
    ap.add_argument("--out", type=Path, required=True, help="the registry's coefficients/ dir")
    args = ap.parse_args(argv)

    fits_by_chip = {}
    for d, chip in CATALOG_NAMES.items():
        fits = fit_chip(args.data, d)
        if fits:
            fits_by_chip[chip] = fits
        else:
            print(f"{chip}: no NCCL sweep under {args.data / d}; derived instead")
    if not fits_by_chip:
        print(f"no NCCL sweep found under {args.data}; nothing written")
        return 1
    entries, table = build_entries(fits_by_chip)

    print(f"{'chip':<12} {'op':<15} {'N':>3} {'floor µs':>9} {'peak B/µs':>11} "
          f"{'trans B/µs':>11} {'geo err':>8}  origin")
    for chip, fits in table.items():
        for (op, n), f in sorted(fits.items()):
            fl, pk, tr = written(f)
            geo = f"{f.geo_error:.3f}x" if not math.isnan(f.geo_error) else "—"
            print(f"{chip:<12} {op:<15} {n:>3} {fl:>9.2f} {pk:>11,} {tr:>11,} {geo:>8}  {f.source}")

    # The spec's published h200 8-rank all-reduce (documents.md §8.7): 15.98 µs, 131,566 and
    # 92,500 B/µs. Show it against this fit, under both readings of message_size.
    h200 = sorted((args.data / "h200_sxm" / "comm" / "nccl").glob("*/nccl_perf.parquet"))
    if h200:
        ref = Fit(15.98e-6, 131566e6, 92500e6)
        for bpe, label in ((HALF_BYTES, "elements x 2 B (this seed)"),
                           (1, "message_size read as bytes")):
            b, t = read_nccl_sweeps(h200[-1], bpe)[("all_reduce", 8)]
            mine = rounded(fit_collective(b, t))
            fl, pk, tr = written(mine)
            print(f"h200 all_reduce 8 rank, {label}: fit {fl:.2f} µs / {pk:,} / {tr:,} B/µs, "
                  f"geo {geometric_error(b, t, mine):.3f}x; published triple geo "
                  f"{geometric_error(b, t, ref):.3f}x; best measured throughput "
                  f"{np.max(b / t) / 1e6:,.0f} B/µs")

    args.out.mkdir(parents=True, exist_ok=True)
    write_set(entries, args.out / "cost-model-collectives.yaml")
    print(f"wrote {len(entries)} entries to {args.out / 'cost-model-collectives.yaml'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
