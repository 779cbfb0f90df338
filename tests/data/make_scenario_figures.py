"""Record every shipped scenario's step figures (the fixture ``scenario_figures.json``).

    PYTHONPATH=. python tests/data/make_scenario_figures.py

For each catalog scenario and each of its pools, prices the fixed batches of
:data:`BATCHES` (decodes, prefills, mixed steps, steps past the token budget, the decode
threshold boundary, padding and an SM budget) and writes ``expected_s``, ``overlap_s``,
``no_overlap_s`` and the five per-resource totals as float64 ``repr`` strings (every bit).
``tests/test_scenario_figures.py`` compares today's code against the file, so a refactor
that must not change figures proves it did not.

    PYTHONPATH=. python tests/data/make_scenario_figures.py --expected-only

rewrites ``expected_s`` alone, after checking that every other recorded figure is unchanged
(to 1e-12 relative): how the file was updated when ``expected_s`` became monotone
(expected.md refinements 6 and 7) while the edges stayed as recorded.

The whole file was last rewritten when the step-trace constants of vLLM on H100
(``compute_derate``, ``host_serial``, ``host_serial_per_request``; calibration/fit/stepfit)
were shipped: only the H100 scenarios' figures changed then, every other pool's were compared
unchanged first.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "scenario_figures.json"
FIELDS = ("expected_s", "overlap_s", "no_overlap_s")

#: name → (batch notation, keyword arguments of jkernel.Batch)
BATCHES = {
    "empty": ("", {}),
    "decode_1": ("1x1@4096", {}),
    "decode_32": ("32x1@4096", {}),
    "decode_256_mixed_ctx": ("128x1@512,128x1@20000", {}),
    "prefill_2048": ("1x2048@0", {}),
    "prefill_chunk_cached": ("1x512@8192", {}),
    "mixed": ("16x1@3000,1x1024@0", {}),
    "mixed_cached": ("64x1@1000,2x700@5000,1x3@100", {}),
    "past_budget": ("1x32768@0", {}),
    "past_budget_mixed": ("4x8192@1000,32x1@2000", {}),
    "threshold_decode": ("1x1@20765", {}),
    "threshold_prefill": ("1x2@20765", {}),
    "threshold_4": ("8x4@1000,8x5@1000", {"decode_threshold": 4}),
    "tiny_beside_long": ("1x2@30000,1x1@0", {}),
    "padded": ("16x1@2048", {"pad_tokens": 48}),
    "sm_budget": ("1x4096@0,8x1@100", {"sm_budget": 66}),
}


def kernels():
    """(scenario, pool role, kernel) for every shipped scenario and pool."""
    import jkernel
    from jkernel import catalog

    for name in catalog.list_scenarios():
        inputs = jkernel.open_inputs(name)
        for i, pool in enumerate(inputs.deployment.pools):
            yield name, pool.role or str(i), jkernel.open_pool(name, i)


def batches():
    from jkernel import Batch

    return {k: Batch.from_spec(spec, **kw) for k, (spec, kw) in BATCHES.items()}


def figures(kernel, named) -> dict:
    """batch name → {field: float} for one kernel (one ``price_many`` call: one program)."""
    from jkernel import RESOURCES

    est = kernel.price_many(list(named.values()))
    out = {}
    for i, name in enumerate(named):
        row = {f: float(getattr(est, f)[i]) for f in FIELDS}
        row.update({f"{r}_s": float(est.per_resource_s[r][i]) for r in RESOURCES})
        out[name] = row
    return out


def main() -> None:
    import math

    sys.path.insert(0, str(ROOT))
    expected_only = "--expected-only" in sys.argv[1:]
    named = batches()
    old = json.loads(OUT.read_text()) if expected_only else None
    doc = {"batches": {k: {"spec": s, **kw} for k, (s, kw) in BATCHES.items()},
           "figures": {}}
    changed = 0
    for scenario, role, k in kernels():
        key = f"{scenario}/{role}"
        rows = {b: {f: repr(v) for f, v in r.items()} for b, r in figures(k, named).items()}
        if expected_only:
            for b, r in rows.items():
                for f, v in r.items():
                    if f != "expected_s" and not math.isclose(
                            float(v), float(old["figures"][key][b][f]), rel_tol=1e-12):
                        raise SystemExit(f"{key} {b} {f} changed: {old['figures'][key][b][f]}"
                                         f" → {v}; only expected_s may be regenerated")
                    if f != "expected_s":
                        r[f] = old["figures"][key][b][f]       # keep the recorded bits
                if r["expected_s"] != old["figures"][key][b]["expected_s"]:
                    changed += 1
                    rel = float(r["expected_s"]) / float(old["figures"][key][b]["expected_s"]) \
                        if float(old["figures"][key][b]["expected_s"]) else float("nan")
                    print(f"  {key} {b}: expected_s × {rel:.6f}")
        doc["figures"][key] = rows
        print(scenario, role, flush=True)
    if expected_only:
        print(f"{changed} expected_s figures changed")
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
