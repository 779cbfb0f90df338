"""Finding the catalog and registry roots, and listing what they hold (resolution.md §1, D18).

The catalog root is ``repos.catalog``, else ``$JKERNEL_CATALOG``, else the catalog shipped
with the package; the registry root likewise with ``repos.registry`` / ``$JKERNEL_REGISTRY``.
The shipped catalog holds both (its ``coefficients/`` folder is the shipped registry).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Repos", "COEFFICIENT_SETS", "shipped_root", "catalog_root", "registry_root",
           "scenario_path", "list_chips", "list_fabrics", "list_models", "list_scenarios",
           "list_coefficient_sets"]

#: The standard coefficient sets of the shipped registry (``coefficients/<set>.yaml``), in the
#: order the shipped scenarios list them: the sets a scenario names to read every cost law.
COEFFICIENT_SETS = ("cost-model-primitives", "cost-model-collectives",
                    "cost-model-host-overheads", "cost-model-attention",
                    "cost-model-recurrent", "cost-model-memory")


@dataclass(frozen=True)
class Repos:
    """Where documents are read from; None fields fall back as documented above."""

    scenarios: str | Path | None = None
    catalog: str | Path | None = None
    registry: str | Path | None = None


def shipped_root() -> Path:
    """The catalog that ships with jkernel.

    A source checkout keeps it in ``catalog/`` beside the package; an installed copy has it
    as the package ``jkernel_catalog``.
    """
    here = Path(__file__).resolve().parent.parent / "catalog"
    if (here / "hardware").is_dir():
        return here
    import jkernel_catalog  # installed data package

    return Path(jkernel_catalog.__file__).resolve().parent


def _env_root(var: str) -> Path | None:
    """The folder an environment variable names; one that is not a folder is refused (it
    used to list nothing without a word)."""
    env = os.environ.get(var)
    if not env:
        return None
    p = Path(env).expanduser()
    if not p.is_dir():
        from .errors import Refusal

        what = "does not exist" if not p.exists() else "is not a folder"
        raise Refusal("R2", f"${var} points at {p}, which {what}; set it to a catalog "
                      f"folder or unset it to use the shipped catalog ({shipped_root()})",
                      field=var)
    return p


def catalog_root(repos: Repos | None = None) -> Path:
    if repos is not None and repos.catalog is not None:
        return Path(repos.catalog)
    return _env_root("JKERNEL_CATALOG") or shipped_root()


def registry_root(repos: Repos | None = None) -> Path:
    if repos is not None and repos.registry is not None:
        return Path(repos.registry)
    return _env_root("JKERNEL_REGISTRY") or shipped_root()


def scenario_path(bundle: str | Path, repos: Repos | None = None) -> Path:
    """A bundle path: joined to ``repos.scenarios`` when relative; a bare name (no suffix,
    not an existing file) is looked up in the catalog's ``scenarios/`` folder."""
    p = Path(bundle)
    if not p.is_absolute() and repos is not None and repos.scenarios is not None:
        return Path(repos.scenarios) / p
    if p.exists():
        return p
    if len(p.parts) == 1 and p.suffix not in (".yaml", ".yml"):
        cand = catalog_root(repos) / "scenarios" / f"{p.name}.yaml"
        if cand.exists():
            return cand
    return p


def _stems(folder: Path, suffix: str = ".yaml") -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(f.stem for f in folder.iterdir() if f.suffix == suffix)


def list_chips(repos: Repos | None = None) -> list[str]:
    return _stems(catalog_root(repos) / "hardware")


def list_fabrics(repos: Repos | None = None) -> list[str]:
    return _stems(catalog_root(repos) / "networks")


def list_models(repos: Repos | None = None) -> list[str]:
    folder = catalog_root(repos) / "models"
    if not folder.is_dir():
        return []
    return sorted(d.name for d in folder.iterdir() if (d / "graph.yaml").is_file())


def list_scenarios(repos: Repos | None = None) -> list[str]:
    return _stems(catalog_root(repos) / "scenarios")


def list_coefficient_sets(repos: Repos | None = None) -> list[str]:
    return _stems(registry_root(repos) / "coefficients")
