"""Shared fixtures.

The tests import the *installed* jkernel (run ``pytest`` from the repository root after
``pip install '.[test]'``): the repository root is appended to ``sys.path`` only so that
``examples/`` can be imported, after site-packages.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
SPEC_CATALOG = DATA / "spec_catalog"
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

# jkernel's entry points turn on the persistent compilation cache in the user's cache folder
# by default; the tests must never write there (a test that wants a cache gives its own).
os.environ["JKERNEL_CACHE_DIR"] = "0"

import jkernel  # noqa: E402

jkernel.enable_x64()


@pytest.fixture(scope="session")
def spec_repos() -> jkernel.Repos:
    """The fixture catalog holding the spec's own coefficient values (vectors.md)."""
    return jkernel.Repos(catalog=SPEC_CATALOG, registry=SPEC_CATALOG)


@lru_cache(maxsize=None)
def spec_kernel(name: str = "deepseek-v3-h200-fp8-tp8") -> jkernel.Kernel:
    repos = jkernel.Repos(catalog=SPEC_CATALOG, registry=SPEC_CATALOG)
    return jkernel.open(SPEC_CATALOG / "scenarios" / f"{name}.yaml", repos)


@lru_cache(maxsize=None)
def catalog_kernel(name: str, pool: str | int | None = None) -> jkernel.Kernel:
    """A kernel of a shipped catalog scenario (cached across tests)."""
    if pool is None:
        return jkernel.open(name)
    return jkernel.open_pool(name, pool)


def bundle_with(tmp: Path, source: Path, **engine) -> Path:
    """A copy of the bundle ``source`` in ``tmp`` with its first pool's engine settings
    updated by ``engine`` (a named file per setting combination)."""
    import yaml

    scenario, deployment = yaml.safe_load_all(source.read_text())
    deployment["pools"][0].setdefault("engine", {}).update(engine)
    out = tmp / ("-".join(f"{k}-{v}" for k, v in engine.items()) + ".yaml")
    out.write_text(yaml.safe_dump_all([scenario, deployment], sort_keys=False))
    return out
