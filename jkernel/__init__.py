"""jkernel: the step-time cost model of LLM inference serving, as pure jitted JAX functions.

Build one kernel per pool and price batches with it::

    import jkernel
    k = jkernel.open("llama-3.1-70b-h100-tp4")          # a catalog scenario, or a path
    est = k.step_time(jkernel.Batch.from_spec("32x1@4096"))
    est.expected_s, est.no_overlap_s, est.bottleneck_name

The public names are below; everything else is importable but not promised.
"""

from .batch import Batch, Request
from .catalog import Repos
from .errors import Refusal
from .kernel import (Kernel, enable_compilation_cache, enable_x64, new, open, open_inputs,
                     open_pool)
from .overheads import Placement
from .params import Params
from .resolve import ENGINE_BEHAVIOUR_VERSION, KERNEL_ASSUMPTION_SET
from .step import RESOURCES, StepEstimate, StepOptions
from .validate import ArgumentError

__version__ = "0.1.0"

__all__ = ["open", "open_pool", "open_inputs", "new", "Kernel", "Batch", "Request",
           "StepEstimate", "StepOptions", "Refusal", "ArgumentError", "Placement", "Params", "Repos",
           "RESOURCES", "enable_x64", "enable_compilation_cache",
           "ENGINE_BEHAVIOUR_VERSION", "KERNEL_ASSUMPTION_SET"]
