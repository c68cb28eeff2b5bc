"""What ``shardwise plan`` prints: ``--params``' model states per ZeRO stage, the ranked plans as a table
(:func:`format_table`) or one JSON object, with ``--explain``'s terms, the runtime options' notes and the free search,
and ``--optimizer muon``'s cost lines."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from shardwise.errors import ConfigError

if TYPE_CHECKING:
    from shardwise.commands.plan import _Ranked

GAP = 1.3  # a free-search gain above this over a --fixed layout is explained term by term


def print_json(args: argparse.Namespace, found: _Ranked) -> int:
    from shardwise.commands.plan_lines import interval_json
    from shardwise.plan.explain import dominant_terms, explain_gap

    stats, cluster, estimates = found.stats, found.cluster, found.estimates
    out = {
        "model": stats.name,
        "params": stats.params_total,
        "devices": cluster.devices,
        "device_type": cluster.name,
        "global_batch": found.global_batch,
        "seq": stats.seq,
        "precision_policy": found.options.run.precision,
        "memory_convention": args.memory_convention,
        "plans": [{**e.to_json(), **interval_json(e, cluster)} for e in estimates],
        "explanation": found.explanation,
    }
    if args.explain:
        out["terms"] = [dominant_terms(e, k=4) for e in estimates]
        out["runtime_options"] = [found.notes(e, args.headroom) for e in estimates]
        if found.free is not None:
            out["free_search"] = {
                "plan": str(found.free.plan),
                "speedup": estimates[0].step_time_s / found.free.step_time_s,
                "why": explain_gap(found.free, estimates[0]),
            }
    if args.optimizer == "muon":
        out["muon"] = [_muon(stats, cluster, e.plan).to_json() for e in estimates]
    print(json.dumps(out, indent=2))
    return 0


def print_text(args: argparse.Namespace, found: _Ranked) -> int:
    from shardwise.commands.plan_lines import interval_lines
    from shardwise.plan.explain import dominant_terms, explain_gap

    stats, cluster, estimates, options = found.stats, found.cluster, found.estimates, found.options
    print(
        f"{stats.name}: {stats.params_total / 1e9:.3g}B parameters, seq {stats.seq}, "
        f"global batch {found.global_batch}, "
        f"{cluster.devices} x {cluster.name} ({cluster.devices_per_node} per node, "
        f"{cluster.memory_bytes / 1e9:.0f} GB, "
        f"{100 * (1 - args.headroom):.0f}% usable), {options.precision} ({options.run.precision}"
        + (
            (
                "; runtime options only where needed to fit)"
                if options.options_for_memory
                else "; runtime options searched)"
            )
            if options.runtime_options
            else ")"
        )
    )
    print(format_table(estimates))
    print(interval_lines(estimates, cluster))
    print(found.explanation)
    if args.optimizer == "muon":
        for i, e in enumerate(estimates, 1):
            print(f"#{i} {_muon(stats, cluster, e.plan).line()}")
    if not args.explain:
        return 0
    for i, e in enumerate(estimates, 1):
        print(f"#{i} {dominant_terms(e, k=4)}")
        said = found.notes(e, args.headroom)
        if said:
            print(f"#{i} runtime options: " + "; ".join(said))
    if found.free is not None:
        gain = estimates[0].step_time_s / found.free.step_time_s
        if gain > 1.0 + 1e-9:
            flag = f" (more than {GAP}x: judge the terms)" if gain > GAP else ""
            print(f"free search{flag}: {explain_gap(found.free, estimates[0])}")
        else:
            print(f"free search: no plan is predicted faster than {estimates[0].plan}")
    return 0


def _muon(stats: Any, cluster: Any, plan: Any) -> Any:
    from shardwise.plan.muon import muon_cost

    return muon_cost(stats, plan, cluster)


def options_text(plan: object) -> str:
    """The runtime options of a plan, short: ``16`` params16, ``C`` chunked loss, ``S`` sharded
    accumulation, ``8t``/``8r`` FP8 linears (tensorwise / rowwise); ``-`` none."""
    marks = [
        m
        for m, on in (
            ("16", getattr(plan, "params16", False)),
            ("C", getattr(plan, "chunked_loss", False)),
            ("S", getattr(plan, "sharded_accumulation", False)),
        )
        if on
    ]
    if getattr(plan, "precision", "") == "fp8":
        marks.append("8" + str(getattr(plan, "fp8_recipe", "tensorwise"))[0])
    return ",".join(marks) or "-"


def format_table(estimates: list) -> str:
    """The ranked plans; ``cp`` and ``ep`` columns appear when a plan uses them; ``options``: the
    runtime options (:func:`options_text`)."""
    extra = [k for k in ("cp", "ep") if any(getattr(e.plan, k) > 1 for e in estimates)]
    head = (
        f"{'#':>2} {'dp':>5} {'zero':>4} {'tp':>3} {'pp':>3} "
        + "".join(f"{k:>3} " for k in extra)
        + f"{'mbs':>4} {'m':>4} {'schedule':<12} {'recompute':<9} {'options':<9} "
        f"{'mem GB':>8} {'step s':>9} {'compute':>9} {'comm':>9} {'bubble':>9} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6}"
    )
    lines = [head]
    for i, e in enumerate(estimates, 1):
        p = e.plan
        dp = f"{p.dp}x{p.shard}" if p.dp > 1 and p.shard > 1 else str(p.dp_size)
        sched = (p.schedule + (f"/v{p.virtual_stages}" if p.virtual_stages > 1 else "")) if p.pp > 1 else "-"
        degrees = "".join(f"{getattr(p, k):>3} " for k in extra)
        lines.append(
            f"{i:>2} {dp:>5} {p.zero:>4} {p.tp:>3} {p.pp:>3} {degrees}{e.micro_batch_size:>4} {p.microbatches:>4} "
            f"{sched:<12} {p.recompute:<9} {options_text(p):<9} {e.memory_total / 1e9:>8.2f} {e.step_time_s:>9.4g} "
            f"{e.time['compute']:>9.3g} "
            f"{e.time['communication']:>9.3g} {e.time['bubble']:>9.3g} {e.tokens_per_s:>10.4g} "
            f"{e.tflops_per_device:>8.3g} {100 * e.mfu:>5.1f}%"
        )
    return "\n".join(lines)


def states_table(args: argparse.Namespace) -> int:
    """``--params N``: model states per device for each ZeRO stage (Rajbhandari et al. 2020, table 1)."""
    from shardwise.plan.memory import StatePolicy, model_state_bytes
    from shardwise.plan.stats import human_count

    if args.params <= 0:
        raise ConfigError(f"--params {args.params:g} must be positive", hint="e.g. --params 7.5e9")
    policy = StatePolicy.named(args.memory_convention, precision=args.precision or "bf16", optimizer=args.optimizer)
    n = args.devices
    rows = [("baseline (DDP)", 0), ("P_os (zero=1)", 1), ("P_os+g (zero=2)", 2), ("P_os+g+p (zero=3)", 3)]
    states = {z: sum(model_state_bytes(args.params, policy, zero=z, shard=n).values()) for _, z in rows}
    if args.json:
        print(
            json.dumps(
                {
                    "params": args.params,
                    "devices": n,
                    "memory_convention": args.memory_convention,
                    "bytes_per_param": {"param": policy.param, "grad": policy.grad, "optimizer": policy.optimizer},
                    "model_states_gb": {f"zero={z}": states[z] / 1e9 for _, z in rows},
                },
                indent=2,
            )
        )
        return 0
    print(
        f"{human_count(args.params)} parameters on {n} data-parallel devices, model states per device "
        f"({args.memory_convention}: {policy.param:g} + {policy.grad:g} + {policy.optimizer:g} bytes per parameter):"
    )
    for name, z in rows:
        print(f"  {name:<18} {states[z] / 1e9:>10.4g} GB")
    return 0
