"""The ``jkernel`` command: price a step, size a pool's memory, list the catalog, derive a model.

    jkernel price SCENARIO --batch 32x1@4096          # expected step time first
    jkernel memory SCENARIO                           # fixed bytes, page, KV pages per rank
    jkernel catalog [chips|fabrics|models|scenarios|sets]
    jkernel provenance SCENARIO                       # every coefficient and assumption used
    jkernel derive CONFIG.json --name NAME [--out catalog/models]
    jkernel replay SCENARIO --requests FILE [--out FILE]   # serve a request trace
    jkernel replay SCENARIO --workload SPEC.yaml [--concurrency N]
    jkernel replay SCENARIO --requests RESULT.json --compare   # against a benchmark run
    jkernel replay SCENARIO --requests FILE --intervals 0.8    # prediction intervals
    jkernel plan MODEL --chip CHIP --gpus N --isl I --osl O [--ttft S] [--itl S] --rate R

SCENARIO is a bundle path or the name of a scenario in the catalog. A disaggregated
deployment is reported pool by pool unless ``--pool`` names one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from . import catalog as _catalog
from .errors import Refusal

__all__ = ["main"]


def _kernels(args):
    from .kernel import open_inputs, open_pool

    if args.pool is not None:
        return [open_pool(args.scenario, args.pool)]
    inputs = open_inputs(args.scenario)
    pools = inputs.deployment.pools
    return [open_pool(args.scenario, i) for i in range(len(pools))]


def _json(obj, **kw) -> str:
    """``obj`` as strict JSON: a NaN or an infinity (a latency of a replay that completed
    no request) becomes null, never the bare ``NaN`` JSON readers refuse."""
    def clean(x):
        if type(x).__module__ == "numpy" and hasattr(x, "item"):     # numpy scalars
            x = x.item()
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    return json.dumps(clean(obj), allow_nan=False, **kw)


def _bundle_file(scenario: str) -> str | None:
    """The bundle file a SCENARIO argument names, when it names a file (an input no output
    may overwrite)."""
    return scenario if Path(scenario).is_file() else None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.3f} ms"


def _title(k) -> str:
    sc = k.inputs.scenario
    pool = k.pool()
    return (f"{sc.name}: {sc.model} on {sc.cluster.hardware}, pool {k.inputs.pool_index} "
            f"({pool.role}), tp {k.plan.tp} dp {k.plan.dp} ep {k.plan.ep}")


def _cmd_price(args) -> int:
    from .batch import Batch
    from .stages import RESOURCES

    batch = Batch.from_spec(args.batch, decode_threshold=args.decode_threshold,
                            sm_budget=args.sm_budget, pad_tokens=args.pad_tokens)
    out = []
    for k in _kernels(args):
        est = k.step_time(batch)
        row = {"scenario": k.inputs.scenario.name, "pool": k.pool().role,
               "batch": args.batch, "requests": len(batch), "tokens": batch.tokens(),
               "expected_s": est.expected_s, "overlap_s": est.overlap_s,
               "no_overlap_s": est.no_overlap_s, "per_resource_s": est.resources(),
               "bottleneck": est.bottleneck_name}
        table = k.breakdown(batch) if args.breakdown else None
        if table is not None:
            row["breakdown"] = table.to_dict(orient="records")
        out.append(row)
        if args.json:
            continue
        print(_title(k))
        print(f"  batch        {args.batch}  ({len(batch)} requests, {batch.tokens()} tokens, "
              f"decode_threshold {batch.decode_threshold})")
        print(f"  expected   {_ms(est.expected_s)}   jkernel's estimate of the step")
        print(f"  overlap    {_ms(est.overlap_s)}   resources overlap within a layer")
        print(f"  no_overlap {_ms(est.no_overlap_s)}   every resource summed (reference)")
        for r in RESOURCES:
            v = est.per_resource_s[r]
            if v > 0:
                print(f"    {r:<8} {_ms(v)}")
        print(f"  bottleneck   {est.bottleneck_name}")
        if table is not None:
            _print_breakdown(table)
    if args.json:
        print(_json(out if len(out) > 1 else out[0], indent=2))
    return 0


def _memory_row(k) -> dict:
    """The memory comparison's terms for one pool (memory.md; jkernel/memory.py rules)."""
    from . import memory as _mem
    fb = k.fixed_bytes()
    mem = k.memory_plan
    page = k.page_bytes()
    pages = k.kv_cache_pages()
    block = k.plan.block_size
    util = k.settings.gpu_memory_utilization
    device = k.device_memory_bytes()
    budget = device * util
    max_len = k.pool().engine.max_model_len          # as stated; 0: unstated
    rules = mem.rules
    applied = _mem.rule_summary(mem)
    return {"scenario": k.inputs.scenario.name, "pool": k.pool().role,
            "engine_version": k.inputs.scenario.engine_version,
            "recipe": "jkernel's recipe (vLLM v0.29 on)" if rules.spec_recipe
            else "vLLM V1 start-up profile",
            "fixed_bytes": {"weights": fb.weights, "activation_peak": fb.activation_peak,
                            "cuda_graph": fb.cuda_graph, "eplb_redundant": fb.eplb_redundant,
                            "comm_buffers": fb.comm_buffers, "total": fb.total()},
            "cuda_graph_charged": applied["cuda_graph_charged"],
            "rules_applied": applied,
            "kv_bytes_per_token": k.kv_bytes_per_token(), "block_size": block,
            "page_bytes": page, "sequence_fixed_bytes": k.sequence_fixed_bytes(),
            "gpu_memory_bytes": device, "gpu_memory_utilization": util,
            "budget_bytes": budget, "kv_bytes": max(0.0, budget - fb.total()),
            "kv_pages": pages, "kv_tokens": pages * block, "max_model_len": max_len,
            "max_concurrency": _mem.max_concurrency(mem, pages, block, max_len)}


def _print_breakdown(table) -> None:
    """The breakdown as a text table: milliseconds per resource over all a term's layers."""
    cols = ("sm_s", "hbm_s", "nvlink_s", "nic_s", "host_s", "expected_s")
    print("  where the time goes (ms over all layers of a kind; expected: on its critical path)")
    head = "".join(f"{c[:-2]:>10}" for c in cols)
    print(f"    {'kind':<14}{'layers':>6}  {'term':<30}{head}{'share':>8}")
    for r in table.itertuples(index=False):
        vals = "".join(f"{getattr(r, c) * 1e3:10.3f}" for c in cols)
        print(f"    {r.kind:<14}{r.layers:>6}  {r.term:<30}{vals}{r.share * 100:7.1f}%")
    tot = "".join(f"{table[c].sum() * 1e3:10.3f}" for c in cols)
    print(f"    {'total':<14}{'':>6}  {'':<30}{tot}{table['share'].sum() * 100:7.1f}%")


def _cmd_memory(args) -> int:
    kernels = list(_kernels(args))
    out = [_memory_row(k) for k in kernels]
    if args.json:
        print(_json(out if len(out) > 1 else out[0], indent=2))
        return 0
    gib = 2.0 ** 30
    for k, row in zip(kernels, out):
        fb = row["fixed_bytes"]
        print(_title(k))
        print(f"  rules        vLLM v{row['engine_version']}: {row['recipe']}")
        applied = row["rules_applied"]
        if applied["sampler"]:
            context = "in" if applied["cuda_context_charged"] else "outside"
            graphs = "charged" if applied["cuda_graph_charged"] else "not charged"
            print(f"               sampler peak: {applied['sampler']}; CUDA-graph estimate "
                  f"{graphs}; CUDA context {context} the non-torch term")
        print(f"  device       {row['gpu_memory_bytes']:>20,.0f} B  "
              f"{row['gpu_memory_bytes'] / gib:8.2f} GiB × utilization "
              f"{row['gpu_memory_utilization']:g}")
        print(f"  budget       {row['budget_bytes']:>20,.0f} B  {row['budget_bytes'] / gib:8.2f} GiB")
        labels = (("weights", "weights"), ("activation peak", "activation_peak"),
                  ("CUDA graphs", "cuda_graph"), ("buffers", "comm_buffers"),
                  ("EPLB redundant", "eplb_redundant"))
        for label, name in labels:
            v = fb[name]
            note = ""
            if name == "cuda_graph" and not row["cuda_graph_charged"]:
                note = "  (captured after the KV cache, from the 1 - utilization margin)"
            print(f"    − {label:<16}{v:>17,d} B  {v / gib:8.2f} GiB{note}")
        print(f"  remains for KV {row['kv_bytes']:>18,.0f} B  {row['kv_bytes'] / gib:8.2f} GiB")
        print(f"  KV bytes per token per rank {row['kv_bytes_per_token']:>14,.0f} B")
        print(f"  page ({row['block_size']} tokens)           {row['page_bytes']:>14,d} B")
        if row["sequence_fixed_bytes"]:
            print(f"  recurrent state per sequence {row['sequence_fixed_bytes']:>13,d} B")
        print(f"  KV pages per rank            {row['kv_pages']:>14,d}")
        print(f"  KV tokens per rank           {row['kv_tokens']:>14,d}")
        if row["max_model_len"]:
            print(f"  Maximum concurrency for {row['max_model_len']:,} tokens per request: "
                  f"{row['max_concurrency']:.2f}x")
        else:
            print("  Maximum concurrency: max_model_len unstated")
    return 0


def _cmd_catalog(args) -> int:
    lists = {"chips": _catalog.list_chips, "fabrics": _catalog.list_fabrics,
             "models": _catalog.list_models, "scenarios": _catalog.list_scenarios,
             "sets": _catalog.list_coefficient_sets}
    what = [args.what] if args.what else list(lists)
    if args.json:
        out = {"catalog": str(_catalog.catalog_root()),
               "registry": str(_catalog.registry_root())}
        out.update({w: lists[w]() for w in what})
        print(_json(out, indent=2))
        return 0
    print(f"catalog  {_catalog.catalog_root()}")
    print(f"registry {_catalog.registry_root()}")
    for w in what:
        names = lists[w]()
        print(f"{w} ({len(names)}):")
        for n in names:
            print(f"  {n}")
    return 0


def _provenance_row(k) -> dict:
    ev, total, assumed = k.evidence()
    return {"scenario": k.inputs.scenario.name, "pool": k.inputs.pool_index,
            "role": k.pool().role, "evidenced": ev, "values": total,
            "assumed": list(assumed),
            "entries": [{"name": p.name, "set": p.set, "method": p.method, "scope": p.scope,
                         **({"fitted_on": p.fitted_on} if p.fitted_on else {}),
                         **({"outside_fitted": p.outside} if p.outside else {})}
                        for p in k.provenance()],
            "overrides": [{"field": o.field, "requested": o.requested,
                           "resolved": o.resolved, "reason": o.reason}
                          for o in k.resolution().overrides]}


def _cmd_provenance(args) -> int:
    kernels = _kernels(args)
    if args.json:
        out = [_provenance_row(k) for k in kernels]
        print(_json(out if len(out) > 1 else out[0], indent=2, default=str))
        return 0
    for k in kernels:
        print(_title(k))
        ev, total, assumed = k.evidence()
        print(f"  {ev} of {total} values evidenced; {len(assumed)} assumed")
        outside = [p for p in k.provenance() if p.outside]
        for p in k.provenance():
            print(f"  {p.name:<56} {p.set:<28} {p.method:<12} {p.scope}")
            if p.fitted_on:
                print(f"  {'':<56} fitted on: {p.fitted_on}")
            if p.outside:
                print(f"  {'':<56} ! outside the data it was fitted on: {p.outside}")
        if outside:
            print(f"  {len(outside)} fitted value(s) used outside the deployments they were "
                  "fitted on (borrowed, not measured)")
        res = k.resolution()
        for o in res.overrides:
            print(f"  override {o.field}: {o.requested!r} → {o.resolved!r} ({o.reason})")
    return 0


def _cmd_derive(args) -> int:
    from . import derive

    derive.check_model_name(args.name)                 # a name, never a path
    if args.out:
        derive.check_models_dir(args.out, args.name, argument="--out")   # before deriving
        path = derive.write_model(args.config, args.name, args.out, args.quant_config)
        print(f"wrote {path}")
        return 0
    import yaml

    doc = derive.derive_file(args.config, name=args.name, quant_config_path=args.quant_config)
    sys.stdout.write(yaml.safe_dump(doc, sort_keys=False, width=100))
    return 0


def _slo(items: list[str] | None):
    """``--goodput ttft:200 tpot:50``: objectives in milliseconds, vLLM's form."""
    from .replay.metrics import SLO

    if not items:
        return None
    keys = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "ntpot": "ntpot_s",
            "e2el": "e2e_s", "e2e": "e2e_s", "request_latency": "e2e_s"}
    kw = {}
    for item in items:
        name, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if name not in keys or not ms >= 0:
            raise ValueError(f"--goodput {item!r}: allowed: KEY:MILLISECONDS with KEY one of "
                             "ttft, tpot, itl, ntpot, e2el")
        kw[keys[name]] = ms / 1e3
    return SLO(**kw)


def _schedule(requests, rate: str | None, seed: int):
    """``--rate R``: the requests' schedule replaced by Poisson arrivals at R per second
    (``inf``: all at once, the pure closed loop under ``--concurrency``)."""
    import numpy as np

    if rate is None:
        return requests
    try:
        r = float(rate)
    except ValueError:
        r = -1.0
    if not r > 0:
        raise ValueError(f"--rate {rate!r}: allowed: requests per second > 0, or inf")
    out = requests.copy()
    n = len(out)
    out["arrival_s"] = (np.zeros(n) if np.isinf(r) else
                        np.cumsum(np.random.default_rng(seed).exponential(1.0 / r, n)))
    return out


def _cmd_replay(args) -> int:
    """Replay a request file, a workload spec or a benchmark result on the scenario's
    pool(s); write one row per request; with --compare, predicted against measured."""
    from . import atomic
    from .kernel import open_inputs, open_pool
    from .replay import (Clients, Window, format_summary, load_requests, load_workload, replay,
                         replay_disaggregated)

    run = None
    clients, window = None, Window.parse(args.warmup, args.cooldown)
    source = args.requests or args.workload
    if args.out:       # checked before the replay runs, never an input's own file
        atomic.check_target(args.out, argument="--out",
                            inputs=[source, _bundle_file(args.scenario)])
    if args.compare and not args.requests:
        raise ValueError("--compare needs --requests with a benchmark client's result (a "
                         "workload spec holds no measurements)")
    if args.workload:
        wl = load_workload(args.workload)              # refusals name the file and key
        requests, clients = wl.requests, wl.clients
        if window.empty:
            window = wl.window
    elif args.compare or str(args.requests).lower().endswith(".json"):
        from .replay.formats import read_benchmark

        run = read_benchmark(args.requests, benchmark=args.benchmark)
        requests, clients = run.requests, run.clients
    else:
        requests = load_requests(args.requests)      # errors name the file and column
        if requests.attrs.get("sorted"):
            print(f"jkernel: {args.requests}: arrivals were not in order; replayed sorted by "
                  "arrival", file=sys.stderr)
    if args.concurrency is not None or args.think_time:
        clients = Clients(args.concurrency if args.concurrency is not None
                          else (clients.concurrency if clients else 0),
                          args.think_time or 0.0)
    requests = _schedule(requests, args.rate, args.seed)
    slo = _slo(args.goodput)
    inputs = open_inputs(args.scenario)
    roles = [p.role for p in inputs.deployment.pools]
    progress = not args.no_progress and sys.stderr.isatty()
    kw = dict(progress=progress, clock=args.clock, clients=clients,
              window=None if window.empty else window)
    if args.pool is not None or len(roles) == 1:
        kernels = [open_pool(args.scenario, args.pool or 0)]
    elif sorted(roles) == ["decode", "prefill"]:
        kernels = [open_pool(args.scenario, "prefill"), open_pool(args.scenario, "decode")]
    else:
        raise ValueError(f"{args.scenario}: replay needs one pool or a prefill and a decode "
                         f"pool, not {', '.join(roles)}")
    if args.intervals is not None:
        return _replay_intervals(args, kernels, requests, kw, source, inputs)
    res = (replay(kernels[0], requests, **kw) if len(kernels) == 1 else
           replay_disaggregated(kernels[0], kernels[1], requests, **kw))
    comparison = None
    if run is not None and args.compare:
        from .replay.compare import compare, format_comparison

        comparison = compare(run, res, slo=slo, window=None if window.empty else window)
    table = res.requests
    if comparison is not None:
        extra = comparison.per_request.drop(columns=["request_id"])
        table = table.assign(**{c: extra[c].to_numpy() for c in extra.columns})
    if args.out:       # whole or not at all: a failed write keeps the previous file
        if str(args.out).lower().endswith((".parquet", ".pq")):
            atomic.write_with(args.out, lambda tmp: table.to_parquet(tmp, index=False))
        else:
            atomic.write_with(args.out, lambda tmp: table.to_csv(tmp, index=False))
    from .replay.metrics import Tool

    good = None
    if slo is not None and comparison is None:
        from .replay.compare import predicted_timings
        from .replay.metrics import goodput

        keep = table["measured"].to_numpy(bool) if "measured" in table else None
        t = predicted_timings(res)
        good = goodput(Tool.VLLM, t if keep is None else t.subset(keep), slo)
    if args.json:
        if comparison is not None:
            doc = {"summary": res.summary,
                   "comparison": comparison.aggregate.to_dict(orient="records")}
        else:
            doc = dict(res.summary)
            if good is not None:
                doc.update(good_requests=good[0], request_goodput=good[1])
        print(_json(doc, indent=2))
    else:
        print(f"{inputs.scenario.name}: {len(requests)} requests from {source}"
              + (f"; {clients.concurrency} closed-loop clients" if clients and clients.closed
                 else ""))
        print(format_summary(res.summary))
        if "measured" in res.requests:
            left = int((~res.requests["measured"]).sum())
            print(f"the summary leaves out {left} warm-up and cool-down requests")
        if good is not None:
            from .replay.compare import objectives

            print(f"goodput as vllm bench serve defines it ({objectives(Tool.VLLM, slo)}): "
                  f"{good[1]:.2f} requests/s ({good[0]} good requests)")
        if comparison is not None:
            print(format_comparison(comparison, per_request=args.per_request))
        if args.out:
            print(f"per-request table: {args.out}")
    return 0


def _replay_intervals(args, kernels, requests, kw, source, inputs) -> int:
    """``replay --intervals LEVEL``: the point replay and the intervals of every metric."""
    from .replay.intervals import format_intervals, intervals_table, replay_intervals
    from .uncertainty.errormodel import load_error_model

    if args.compare:
        raise ValueError("--intervals and --compare: compare the point replay first, then "
                         "ask for intervals")
    if not 0 < args.intervals < 1:
        raise ValueError(f"--intervals {args.intervals}: allowed: a level in (0, 1), e.g. 0.8")
    if args.draws < 2:
        raise ValueError(f"--draws {args.draws}: allowed: 2 or more")
    em = load_error_model(args.error_model) if args.error_model else None
    ik = dict(level=args.intervals, draws=args.draws, error_model=em, clock=kw["clock"],
              clients=kw["clients"], window=kw["window"], seed=args.seed)
    target = kernels if len(kernels) > 1 else kernels[0]
    if args.workload and args.rate is None:
        from .replay import read_spec

        res = replay_intervals(target, workload=read_spec(args.workload), seeds=args.seeds,
                               **ik)
    else:
        if args.seeds is not None:
            raise ValueError("--seeds needs --workload (a request file's arrivals are given)")
        res = replay_intervals(target, requests, **ik)
    if args.out:
        out = args.out
        if str(out).lower().endswith((".parquet", ".pq")):
            res.point.requests.to_parquet(out, index=False)
        else:
            res.point.requests.to_csv(out, index=False)
    if args.json:
        doc = {"level": res.level, "draws": len(res.results),
               "extrapolation": {"class": res.extrapolation.cls,
                                 "flags": [f.__dict__ for f in res.extrapolation.flags]},
               "error_model": res.error_model, "notes": list(res.notes),
               "metrics": intervals_table(res).to_dict(orient="records")}
        print(json.dumps(doc, indent=2, default=float))
    else:
        print(f"{inputs.scenario.name}: {len(requests)} requests from {source}; "
              f"{res.level:.0%} prediction intervals")
        print(format_intervals(res))
        if args.out:
            print(f"per-request table (the point replay): {args.out}")
    return 0


def _add_plan(sub) -> None:
    """``jkernel plan``: the deployment search (jkernel.search)."""
    s = sub.add_parser("plan", help="search the deployments of a model on a fleet for a "
                       "workload shape and latency targets")
    s.add_argument("model", help="catalog model name")
    s.add_argument("--chip", required=True, help="catalog chip name (jkernel catalog chips)")
    s.add_argument("--gpus", required=True, type=int, help="GPUs in the fleet")
    s.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs per node (default: the chip's node, else 8)")
    s.add_argument("--fabric", default="ib-400g", help="inter-node fabric (catalog name)")
    s.add_argument("--isl", required=True, type=int, help="prompt tokens per request")
    s.add_argument("--osl", required=True, type=int, help="output tokens per request")
    s.add_argument("--ttft", type=float, default=0.0, help="p90 TTFT target, seconds")
    s.add_argument("--itl", type=float, default=0.0, help="p90 ITL target, seconds")
    load = s.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, default=0.0, help="requests/s over the fleet")
    load.add_argument("--concurrency", type=int, default=0, help="requests in flight")
    s.add_argument("--mode", choices=["colocated", "disaggregated", "both"], default="both")
    s.add_argument("--requests", type=int, default=0,
                   help="synthetic requests replayed (default: a minute of arrivals)")
    s.add_argument("--replay-top", type=int, default=3,
                   help="candidates of each mode replayed after the pre-screen")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--sla-confidence", type=float, default=0.0, metavar="P",
                   help="rank by P(every SLA target met) ≥ P instead of the point estimate "
                        "(docs/intervals.md)")
    s.add_argument("--sla-draws", type=int, default=16, metavar="K",
                   help="draws of each replayed candidate's interval replay, which give "
                        "P(SLA met) (0: none; default 16)")
    s.add_argument("--workers", type=int, default=0,
                   help="worker processes (default: one per core, at most 4)")
    s.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="evaluate on a Ray cluster ('auto', 'local' or host:port)")
    s.add_argument("--json", default=None, metavar="FILE", nargs="?", const="-",
                   help="write the table and front as JSON (to stdout with no FILE)")
    s.add_argument("--csv", default=None, metavar="FILE", help="write the table as CSV")
    s.add_argument("--plot", default=None, metavar="FILE.png", help="plot the fronts")
    s.add_argument("--all", action="store_true", help="print every row, refused included")
    s.set_defaults(fn=_cmd_plan)


def _cmd_plan(args) -> int:
    import os

    from . import atomic, search

    quiet = args.json == "-"
    # Every output checked before the search (a search can run for minutes).
    atomic.check_targets({"--csv": args.csv, "--json": None if args.json == "-" else args.json,
                          "--plot": args.plot})
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            from .validate import ArgumentError

            raise ArgumentError("--plot", "needs matplotlib (pip install "
                                "'jkernel[notebooks]'); nothing was run")
    log = (lambda m: print(m, file=sys.stderr, flush=True))
    workers = args.workers or max(1, min(4, os.cpu_count() or 1))
    modes = ("colocated", "disaggregated") if args.mode == "both" else (args.mode,)
    res = search.plan(args.model, chip=args.chip, gpus=args.gpus, isl=args.isl,
                      osl=args.osl, ttft_s=args.ttft, itl_s=args.itl, rate=args.rate,
                      concurrency=args.concurrency, gpus_per_node=args.gpus_per_node,
                      fabric=args.fabric, modes=modes, requests=args.requests,
                      seed=args.seed, replay_top=args.replay_top, workers=workers,
                      ray_address=args.ray, log=log, sla_confidence=args.sla_confidence,
                      sla_draws=args.sla_draws)
    if args.csv:
        atomic.write_with(args.csv, lambda tmp: res.table.to_csv(tmp, index=False))
    if args.json:
        text = _json(res.to_json(), indent=2, default=str)
        if args.json == "-":
            print(text)
        else:
            atomic.write_text(args.json, text)
    if args.plot:
        atomic.write_with(args.plot, lambda tmp: search.plot_front(res, str(tmp)))
    if not quiet:
        print(search.format_table(res, every=args.all))
    return 0 if not res.front.empty else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jkernel", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def scenario_cmd(name, help_):
        s = sub.add_parser(name, help=help_)
        s.add_argument("scenario", help="bundle path or catalog scenario name")
        s.add_argument("--pool", default=None, help="pool role or index (default: every pool)")
        s.add_argument("--json", action="store_true", help="print JSON")
        return s

    s = scenario_cmd("price", "price one step")
    s.add_argument("--batch", required=True,
                   help="NxS@C[,…]: N requests of S scheduled tokens at C cached tokens")
    s.add_argument("--decode-threshold", type=int, default=1)
    s.add_argument("--pad-tokens", type=int, default=0)
    s.add_argument("--sm-budget", type=int, default=0)
    s.add_argument("--breakdown", action="store_true",
                   help="also print where the time goes: layer kind × named term × resource")
    s.set_defaults(fn=_cmd_price)
    scenario_cmd("memory", "fixed bytes, page bytes, KV pages and tokens per rank"
                 ).set_defaults(fn=_cmd_memory)
    s = scenario_cmd("provenance", "coefficients, assumptions and overrides of a kernel")
    s.set_defaults(fn=_cmd_provenance)
    s = sub.add_parser("catalog", help="list chips, fabrics, models, scenarios, sets")
    s.add_argument("what", nargs="?", choices=["chips", "fabrics", "models", "scenarios",
                                               "sets"])
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(fn=_cmd_catalog)
    s = sub.add_parser("derive", help="derive a model graph from a Hugging Face config.json")
    s.add_argument("config")
    s.add_argument("--name", required=True, help="catalog model name")
    s.add_argument("--quant-config", default=None, help="hf_quant_config.json beside it")
    s.add_argument("--out", default=None, help="models folder to write <name>/ into "
                                              "(default: print the graph)")
    s.set_defaults(fn=_cmd_derive)
    s = scenario_cmd("replay", "replay a request trace through vLLM's scheduler, priced "
                     "step by step")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--requests",
                     help="CSV or Parquet: request_id, arrival_time_us (or arrival_s), "
                          "input_tokens, output_tokens; or a residency-vllm trace.csv; or a "
                          "benchmark client's result (vLLM bench serve, guidellm, "
                          "inference-perf JSON; llm-d lmbench CSV)")
    src.add_argument("--workload", help="a workload spec (YAML, docs/workloads.md)")
    s.add_argument("--compare", action="store_true",
                   help="predicted against measured, per request and in aggregate, in the "
                        "benchmark client's own metric definitions")
    s.add_argument("--benchmark", type=int, default=None,
                   help="which benchmark of a guidellm report holding several")
    s.add_argument("--concurrency", type=int, default=None,
                   help="closed-loop clients: each sends its next request when its previous "
                        "one completes (no earlier than its arrival: a rate cap)")
    s.add_argument("--think-time", type=float, default=0.0,
                   help="seconds a closed-loop client waits before its next request")
    s.add_argument("--rate", default=None,
                   help="replace the arrivals by Poisson arrivals at this rate (requests/s; "
                        "'inf': all at once)")
    s.add_argument("--seed", type=int, default=0, help="seed of --rate's arrivals")
    s.add_argument("--warmup", default=None,
                   help="leave out of the summary: N requests, P%% of them, or Ts seconds")
    s.add_argument("--cooldown", default=None, help="likewise, at the end")
    s.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="service-level objectives in ms (ttft, tpot, itl, ntpot, e2el)")
    s.add_argument("--per-request", type=int, default=0, metavar="N",
                   help="with --compare, also list the first N requests")
    s.add_argument("--out", default=None, help="per-request table (.csv or .parquet)")
    s.add_argument("--clock", default="expected_s", choices=["expected_s", "no_overlap_s"])
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--intervals", type=float, default=None, metavar="LEVEL",
                   help="prediction intervals at LEVEL (e.g. 0.8) for every metric, with "
                        "the share of each source (docs/intervals.md)")
    s.add_argument("--draws", type=int, default=32,
                   help="with --intervals: draws replayed in lockstep (default 32)")
    s.add_argument("--seeds", type=int, default=None,
                   help="with --intervals and --workload: workload seeds drawn (default 4)")
    s.add_argument("--error-model", default=None, metavar="FILE",
                   help="with --intervals: an error-model document (default the catalog's)")
    s.set_defaults(fn=_cmd_replay)
    _add_plan(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except Refusal as exc:
        print(f"jkernel: refused: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:                          # ArgumentError names the argument
        print(f"jkernel: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:                          # Ctrl-C: workers already stopped
        print("jkernel: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:            # `jkernel catalog | head`: the reader left early
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:             # a write that failed (full disk …): named, no traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"jkernel: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":   # python -m jkernel.cli
    sys.exit(main())
