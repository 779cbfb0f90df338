"""jkernel: the step-time cost model of LLM inference serving, as pure jitted JAX functions.

Build one kernel per pool and price batches with it::

    import jkernel
    k = jkernel.open("llama-3.1-70b-h100-tp4")          # a catalog scenario, or a path
    est = k.step_time(jkernel.Batch.from_spec("32x1@4096"))
    est.expected_s, est.no_overlap_s, est.bottleneck_name

The public names are below; everything else is importable but not promised.
"""

from importlib import import_module as _import

#: Public name → the module that defines it. Loaded on first use (PEP 562), so that
#: ``jkernel catalog`` or ``jkernel derive`` start without importing JAX.
_HOME = {
    "Batch": "batch", "Request": "batch", "Repos": "catalog", "Refusal": "errors",
    "Kernel": "kernel", "enable_compilation_cache": "runtime", "enable_x64": "runtime",
    "new": "kernel", "open": "kernel", "open_inputs": "kernel", "open_pool": "kernel",
    "Placement": "overheads", "Params": "params", "ENGINE_BEHAVIOUR_VERSION": "resolve",
    "EngineSettings": "resolve", "KERNEL_ASSUMPTION_SET": "resolve", "RESOURCES": "stages",
    "Resources": "stages", "StepEstimate": "step", "StepOptions": "stages", "ArgumentError": "validate",
    "StepPricer": "pricer",
}


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'jkernel' has no attribute {name!r}")
    value = getattr(_import(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOME))


__version__ = "0.1.0"

__all__ = ["open", "open_pool", "open_inputs", "new", "Kernel", "Batch", "Request",
           "StepEstimate", "StepPricer", "StepOptions", "EngineSettings", "Refusal",
           "ArgumentError", "Placement", "Params", "Repos",
           "RESOURCES", "Resources", "enable_x64", "enable_compilation_cache",
           "ENGINE_BEHAVIOUR_VERSION", "KERNEL_ASSUMPTION_SET"]
