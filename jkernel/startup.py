"""Whether vLLM would start a pool: the start-up refusal and the pages one request holds.

vLLM v1 (``kv_cache_utils._check_enough_kv_cache_memory``, v0.8 to v0.31) stops the engine at
start-up when no memory is left for the KV cache, or when one request of ``max_model_len``
tokens would not fit the cache. These functions ask the same of a built
:class:`~jkernel.Kernel` (its own memory figures, :mod:`jkernel.memory`), for the entry points
that start an engine from documents: ``jkernel.open`` / ``open_pool``
(:func:`check_opened`), the replay and the planner (:func:`check_start`). The replay's
scheduler and the planner size requests with :func:`request_pages`.

Nothing here changes a kernel; ``jkernel.new`` and ``Kernel.kv_cache_pages`` never refuse
(memory.md §5 keeps ``pages = max(0, …)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import Refusal

if TYPE_CHECKING:                      # the kernel imports this module
    from .kernel import Kernel

__all__ = ["request_pages", "longest_fitting_request", "start_refusal", "check_start",
           "check_opened"]

GIB = 2.0 ** 30


def request_pages(k: "Kernel", tokens: int) -> int:
    """KV pages one running request of ``tokens`` tokens holds on ``k``'s pool (per rank):
    ``ceil(sequence_variable_bytes(tokens) / page)`` plus its recurrent state,
    ``ceil(sequence_fixed_bytes() / page)`` (memory.md §5: each running sequence's fixed
    state is charged against the same pages; 0 unless the model has recurrent layers).
    0 for a pool whose page holds nothing. The one fit rule of a request: the start
    refusal, the planner and the replay's scheduler
    (:meth:`jkernel.replay.scheduler.PoolLimits.request_pages`, its cached form) read it."""
    page = int(k.page_bytes())
    if page <= 0:
        return 0
    return (-(-int(k.sequence_variable_bytes(int(tokens))) // page)
            + -(-int(k.sequence_fixed_bytes()) // page))


def longest_fitting_request(k: "Kernel", pages: int) -> int:
    """The longest request (tokens) whose :func:`request_pages` fit ``pages``, 0 when none
    does: binary search on the kernel's own sequence sizing (vLLM
    ``estimate_max_model_len`` searches the same way)."""
    page = k.page_bytes()

    def fits(n: int) -> bool:
        return request_pages(k, n) <= pages

    if page <= 0 or not fits(1):
        return 0
    lo, hi = 1, max(1, pages) * max(k.plan.block_size, 1) * max(k.plan.dcp, 1) + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def start_refusal(k: "Kernel", *, max_model_len: int | None = None, pool: str | None = None,
                  what: str = "max_model_len") -> Refusal | None:
    """Why vLLM would not start this pool, as a :class:`~jkernel.Refusal` (code ``FIT``),
    or None when it would.

    vLLM stops the engine when the memory left for the KV cache after the start-up profile
    is not positive (it names ``gpu_memory_utilization`` as the setting to raise), and when
    one request of ``max_model_len`` tokens needs more KV cache than is left (it gives the
    needed and the available GiB and its estimate of the longest length that would fit).
    jkernel asks the same of its own figures: no whole KV page left, or fewer pages than one
    request of ``max_model_len`` (when given) occupies. ``what`` names that length in the
    message (``max_model_len`` for a deployment, the workload's request length for the
    planner); ``pool`` is the pool's document path, under which the refusal names its field.

    The spec's memory recipe stays as it is (memory.md §5: ``pages = max(0, …)``; its
    vectors build pools whose fixed bytes overflow the budget): this refusal is asked for by
    the entry points that start an engine from documents (``jkernel.open`` /
    ``open_pool``, the replay, the planner), not by ``new`` or ``kv_cache_pages``. The spec
    lists no refusal for it (resolution.md §13); vLLM v0.31.0 refuses, so jkernel does
    (README precedence rule 2)."""
    util = float(k.settings.gpu_memory_utilization)
    device = float(k.device_memory_bytes())
    budget = device * util
    fb = k.fixed_bytes()
    fixed = fb.total()
    page = int(k.page_bytes())
    pages = int(k.kv_cache_pages())
    avail = budget - fixed
    bundle_file = k.inputs.bundle_file
    if page > 0 and pages <= 0:
        parts = (f"weights {fb.weights / GIB:.2f}, activation peak "
                 f"{fb.activation_peak / GIB:.2f}, CUDA graphs {fb.cuda_graph / GIB:.2f}, "
                 f"buffers {fb.comm_buffers / GIB:.2f}")
        where = (f"the memory budget {budget / GIB:.2f} GiB (gpu_memory_utilization "
                 f"{util:g} of {device / GIB:.2f} GiB)")
        if avail <= 0:
            state = (f"exceed {where}: no memory is left for the KV cache blocks")
        else:
            state = (f"leave {avail / GIB:.3f} GiB of {where}, less than one KV page of "
                     f"{page:,} B: no KV cache block fits")
        return Refusal(
            "FIT", f"fixed bytes {fixed / GIB:.2f} GiB per rank ({parts}) {state}. vLLM "
            "would not start the engine; raise gpu_memory_utilization or spread the model "
            "over more GPUs", field=None if pool is None
            else f"{pool}.engine.gpu_memory_utilization", file=bundle_file)
    if max_model_len and page > 0:
        need = request_pages(k, int(max_model_len))
        if need > pages:
            longest = longest_fitting_request(k, pages)
            hint = (f"; the longest request the cache holds is about {longest:,} tokens"
                    if longest > 0 else "")
            subject = (f"max_model_len {int(max_model_len)}" if what == "max_model_len"
                       else f"{what} of {int(max_model_len)} tokens")
            lower = "max_model_len" if what == "max_model_len" else "the request length"
            return Refusal(
                "FIT", f"{subject} needs {need} KV pages ({need * page / GIB:.2f} GiB per "
                f"rank) but only {pages} fit ({pages * page / GIB:.2f} GiB){hint}; vLLM "
                f"would not start (lower {lower} or raise gpu_memory_utilization)",
                field=None if pool is None else
                (f"{pool}.engine.max_model_len" if what == "max_model_len" else pool),
                file=bundle_file)
    return None


def check_start(k: "Kernel", *, max_model_len: int | None = None, pool: str | None = None,
                what: str = "max_model_len") -> None:
    """Raise :func:`start_refusal`'s refusal when there is one. ``pool`` is the document
    path of the pool (``"pools[0]"``) the refusal's field is named under."""
    refusal = start_refusal(k, max_model_len=max_model_len, pool=pool, what=what)
    if refusal is not None:
        raise refusal


def check_opened(k: "Kernel") -> None:
    """The start-up check of ``jkernel.open`` / ``open_pool``: :func:`check_start` with the
    stated max_model_len, when the bundle states its gpu_memory_utilization.

    A departure from the spec, which lists no such refusal for ``open`` (resolution.md §1,
    §13) and whose vectors open pools whose fixed bytes overflow the budget at the
    utilization jkernel assumes when none is stated (D15, 0.92): those keep memory.md §5's
    pages = max(0, …) and are priced. A budget the bundle states is held to vLLM v0.31.0's
    start-up check (README precedence rule 2). ``new`` never refuses here."""
    if k.assumption("gpu_memory_utilization") is not None:
        return
    check_start(k, max_model_len=k.pool().engine.max_model_len,
                pool=f"pools[{k.inputs.pool_index}]")
