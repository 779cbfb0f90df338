"""The ``jkernel`` command: price a step, size a pool's memory, list the catalog, derive a model.

    jkernel price SCENARIO --batch 32x1@4096          # expected step time first
    jkernel memory SCENARIO                           # fixed bytes, page, KV pages per rank
    jkernel catalog [chips|fabrics|models|scenarios|sets]
    jkernel provenance SCENARIO                       # every coefficient and assumption used
    jkernel derive CONFIG.json --name NAME [--out catalog/models]

SCENARIO is a bundle path or the name of a scenario in the catalog. A disaggregated
deployment is reported pool by pool unless ``--pool`` names one.
"""

from __future__ import annotations

import argparse
import json
import sys

from . import catalog as _catalog
from .batch import Batch
from .errors import Refusal
from .step import RESOURCES

__all__ = ["main"]


def _kernels(args):
    from .kernel import open_inputs, open_pool

    if args.pool is not None:
        return [open_pool(args.scenario, args.pool)]
    inputs = open_inputs(args.scenario)
    pools = inputs.deployment.pools
    return [open_pool(args.scenario, i) for i in range(len(pools))]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.3f} ms"


def _title(k) -> str:
    sc = k.inputs.scenario
    pool = k.deployment()
    return (f"{sc.name}: {sc.model} on {sc.cluster.hardware}, pool {k.inputs.pool_index} "
            f"({pool.role}), tp {k.plan.tp} dp {k.plan.dp} ep {k.plan.ep}")


def _cmd_price(args) -> int:
    batch = Batch.from_spec(args.batch, decode_threshold=args.decode_threshold,
                            sm_budget=args.sm_budget, pad_tokens=args.pad_tokens)
    out = []
    for k in _kernels(args):
        est = k.step_time(batch)
        row = {"scenario": k.inputs.scenario.name, "pool": k.deployment().role,
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
        print(f"  expected   {_ms(est.expected_s)}   jkernel's estimate (expected.md)")
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
        print(json.dumps(out if len(out) > 1 else out[0], indent=2))
    return 0


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
    out = []
    for k in _kernels(args):
        fb = k.fixed_bytes()
        page = k.page_bytes()
        pages = k.kv_cache_pages()
        block = k.plan.block_size
        row = {"scenario": k.inputs.scenario.name, "pool": k.deployment().role,
               "fixed_bytes": {"weights": fb.weights, "activation_peak": fb.activation_peak,
                               "cuda_graph": fb.cuda_graph, "eplb_redundant": fb.eplb_redundant,
                               "comm_buffers": fb.comm_buffers, "total": fb.total()},
               "kv_bytes_per_token": k.kv_bytes_per_token(), "block_size": block,
               "page_bytes": page, "sequence_fixed_bytes": k.sequence_fixed_bytes(),
               "gpu_memory_bytes": k.inputs.chip.memory_bytes,
               "gpu_memory_utilization": k.settings["gpu_memory_utilization"],
               "kv_pages": pages, "kv_tokens": pages * block}
        out.append(row)
        if args.json:
            continue
        gib = 2.0 ** 30
        print(_title(k))
        print("  fixed bytes per rank")
        for name in ("weights", "activation_peak", "cuda_graph", "eplb_redundant",
                     "comm_buffers", "total"):
            v = row["fixed_bytes"][name]
            print(f"    {name:<16}{v:>20,d} B  {v / gib:8.2f} GiB")
        print(f"  KV bytes per token per rank {k.kv_bytes_per_token():>14,.0f} B")
        print(f"  page ({block} tokens)           {page:>14,d} B")
        if row["sequence_fixed_bytes"]:
            print(f"  recurrent state per sequence {row['sequence_fixed_bytes']:>13,d} B")
        print(f"  HBM {k.inputs.chip.memory_bytes:,.0f} B × utilization "
              f"{row['gpu_memory_utilization']:g}")
        print(f"  KV pages per rank            {pages:>14,d}")
        print(f"  KV tokens per rank           {pages * block:>14,d}")
    if args.json:
        print(json.dumps(out if len(out) > 1 else out[0], indent=2))
    return 0


def _cmd_catalog(args) -> int:
    lists = {"chips": _catalog.list_chips, "fabrics": _catalog.list_fabrics,
             "models": _catalog.list_models, "scenarios": _catalog.list_scenarios,
             "sets": _catalog.list_coefficient_sets}
    what = [args.what] if args.what else list(lists)
    print(f"catalog  {_catalog.catalog_root()}")
    print(f"registry {_catalog.registry_root()}")
    for w in what:
        names = lists[w]()
        print(f"{w} ({len(names)}):")
        for n in names:
            print(f"  {n}")
    return 0


def _cmd_provenance(args) -> int:
    for k in _kernels(args):
        print(_title(k))
        ev, total, assumed = k.evidence()
        print(f"  {ev} of {total} values evidenced; {len(assumed)} assumed")
        for p in k.provenance():
            print(f"  {p.name:<56} {p.set:<28} {p.method:<12} {p.scope}")
        res = k.resolved()
        for o in res.overrides:
            print(f"  override {o.field}: {o.requested!r} → {o.resolved!r} ({o.reason})")
    return 0


def _cmd_derive(args) -> int:
    from . import derive

    if args.out:
        path = derive.write_model(args.config, args.name, args.out, args.quant_config)
        print(f"wrote {path}")
        return 0
    import yaml

    doc = derive.derive_file(args.config, name=args.name, quant_config_path=args.quant_config)
    sys.stdout.write(yaml.safe_dump(doc, sort_keys=False, width=100))
    return 0


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
    s.set_defaults(fn=_cmd_catalog)
    s = sub.add_parser("derive", help="derive a model graph from a Hugging Face config.json")
    s.add_argument("config")
    s.add_argument("--name", required=True, help="catalog model name")
    s.add_argument("--quant-config", default=None, help="hf_quant_config.json beside it")
    s.add_argument("--out", default=None, help="models folder to write <name>/ into "
                                              "(default: print the graph)")
    s.set_defaults(fn=_cmd_derive)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except Refusal as exc:
        print(f"jkernel: refused: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"jkernel: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:            # `jkernel catalog | head`: the reader left early
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":   # python -m jkernel.cli
    sys.exit(main())
