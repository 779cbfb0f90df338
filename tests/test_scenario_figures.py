"""Every shipped scenario's step figures against the values recorded before the named-terms
redesign (``tests/data/scenario_figures.json``, written by
``tests/data/make_scenario_figures.py``).

The edges (``overlap_s``, ``no_overlap_s``) and the per-resource totals must match to 1e-12
relative: splitting a layer into named terms regroups sums such as
``(dense + shared FLOPs)/(P·ε)`` into ``dense/(P·ε) + shared/(P·ε)``, which moves the last
bit or two of a float64 result and nothing more. ``expected_s`` is compared the same way
against the recorded figures, which were regenerated (for ``expected_s`` only) when its
monotone form landed.
"""

from __future__ import annotations

import json
import math

import pytest

from conftest import DATA, catalog_kernel

FIXTURE = json.loads((DATA / "scenario_figures.json").read_text())
RTOL = 1e-12


def _batches():
    import jkernel

    return {name: jkernel.Batch.from_spec(spec["spec"], **{k: v for k, v in spec.items()
                                                           if k != "spec"})
            for name, spec in FIXTURE["batches"].items()}


@pytest.mark.parametrize("key", sorted(FIXTURE["figures"]))
def test_shipped_scenario_figures_unchanged(key):
    scenario, role = key.split("/")
    import jkernel

    inputs = jkernel.open_inputs(scenario)
    roles = [p.role or str(i) for i, p in enumerate(inputs.deployment.pools)]
    k = catalog_kernel(scenario, roles.index(role))
    named = _batches()
    est = k.price_many(list(named.values()))
    bad = []
    for i, name in enumerate(named):
        want = FIXTURE["figures"][key][name]
        got = {"expected_s": est.expected_s[i], "overlap_s": est.overlap_s[i],
               "no_overlap_s": est.no_overlap_s[i],
               **{f"{r}_s": est.per_resource_s[r][i] for r in jkernel.RESOURCES}}
        for field, w in want.items():
            w, g = float(w), float(got[field])
            if not math.isclose(g, w, rel_tol=RTOL, abs_tol=0.0):
                bad.append(f"{name}.{field}: recorded {w!r}, now {g!r}")
    assert not bad, "\n".join(bad)
