"""The sensitivity notebook's elasticities agree with finite differences of the same function.

``examples.sensitivity.elasticities`` differentiates log(step time) with ``jax.jacfwd``;
here it is compared, parameter by parameter, with central differences in log space, in
float64, to a relative 1e-4, for the notebook's three deployments on a sample of batches.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jkernel  # noqa: E402
from examples import sensitivity as X  # noqa: E402

SCENARIOS = ROOT / "catalog" / "scenarios"
DEPLOYMENTS = {
    "dense": "llama-3.1-70b-h100-tp4",
    "moe": "qwen3-30b-a3b-h200-ep",
    "mla": "deepseek-v3-h200-fp8-tp8",
}
# A sample of points: a decode batch, a prefill chunk, and a mixed batch (one bucket).
SAMPLE = ["8x1@2048", "1x4096@0", "15x1@8192,1x1024@0"]
RTOL = 1e-4


@pytest.fixture(scope="module", params=sorted(DEPLOYMENTS))
def kernel(request):
    return jkernel.open(SCENARIOS / f"{DEPLOYMENTS[request.param]}.yaml")


@pytest.fixture(scope="module")
def grid(kernel):
    """The exact elasticities of every sample point, from one jitted ``jacfwd`` program."""
    return X.elasticity_grid(kernel, [jkernel.Batch.from_spec(s) for s in SAMPLE])


def _agree(kernel, names, exact, spec: str, field: str) -> None:
    fd = X.finite_difference_elasticities(kernel, jkernel.Batch.from_spec(spec), field)
    assert set(names) == set(fd) == set(kernel.params)
    f = np.array([fd[n] for n in names])
    a = np.asarray(exact)
    assert np.all(np.isfinite(a)) and np.any(np.abs(a) > 0.1)
    np.testing.assert_allclose(a, f, rtol=RTOL, atol=1e-9,
                               err_msg=f"{kernel.inputs.scenario.name} {spec} {field}")


@pytest.mark.parametrize("i", range(len(SAMPLE)), ids=SAMPLE)
def test_elasticities_match_finite_differences(kernel, grid, i):
    names, E, _ = grid
    _agree(kernel, names, E[i], SAMPLE[i], "expected_s")


def test_grid_times_are_step_times(kernel, grid):
    _, _, t = grid
    for i, spec in enumerate(SAMPLE):
        assert t[i] == pytest.approx(kernel.step_time(jkernel.Batch.from_spec(spec)).expected_s,
                                     rel=1e-12)


def test_single_batch_helper_and_no_overlap_edge():
    """``elasticities(kernel, batch)`` itself, and the reference's NoOverlap edge."""
    k = jkernel.open(SCENARIOS / f"{DEPLOYMENTS['dense']}.yaml")
    spec = SAMPLE[2]
    for field in ("expected_s", "no_overlap_s"):
        e = X.elasticities(k, jkernel.Batch.from_spec(spec), field)
        names = sorted(e)
        _agree(k, names, [e[n] for n in names], spec, field)


def test_a_rate_and_its_scale_move_time_together(grid):
    """Two parameters that only enter as a product have identical elasticities: a check
    that the derivative reaches the right leaves of the pytree."""
    names, E, _ = grid
    bw, derate = E[:, names.index("hbm_bytes_per_s")], E[:, names.index("hbm_derate")]
    np.testing.assert_allclose(bw, derate, rtol=1e-12)
    assert bw[0] < 0                       # decoding: more bandwidth, a shorter step


def test_scaled_params():
    k = jkernel.open(SCENARIOS / f"{DEPLOYMENTS['dense']}.yaml")
    p = X.scaled_params(k, {"hbm_bytes_per_s": 1.2, "host_serial": 2.0})
    assert float(p["hbm_bytes_per_s"]) == pytest.approx(1.2 * float(k.params["hbm_bytes_per_s"]))
    with pytest.raises(KeyError):
        X.scaled_params(k, {"no_such_parameter": 2.0})
