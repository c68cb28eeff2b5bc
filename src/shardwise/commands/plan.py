"""``shardwise plan``: rank the parallel layouts of a model on a cluster (a dry run: no devices used)."""

from __future__ import annotations

import argparse
import json
import os

from shardwise.config import check_input_file
from shardwise.errors import ConfigError

EXAMPLES = """examples:
  shardwise plan --model gpt --devices 4 --device-type cpu
  shardwise plan --model-spec '{"layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq": 2048}' \\
                 --devices 1024 --devices-per-node 8 --device-type h100 --global-batch 1536
  shardwise plan --model gpt3-13b --devices 64 --device-type a100-80gb --fixed dp=8,tp=8 --json
  shardwise plan --script my_model.py --devices 8 --device-type calibrated.json
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose DP/ZeRO/TP/PP degrees, microbatches and recomputation for a model",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="built-in model: gpt (shardwise's GPT), gpt2, gpt3-1.3b, gpt3-13b, gpt3-175b")
    src.add_argument("--model-spec", help='transformer shape as JSON (or a JSON file): {"layers", "hidden", "heads", "vocab", "seq"}'
                                          ' and optional "ffn", "kv_heads", "tied_embeddings"')
    src.add_argument("--script", help="Python file defining MODEL_SPEC, or build_model() and example_input(device)")
    p.add_argument("--devices", type=int, required=True, help="number of devices (processes)")
    p.add_argument("--devices-per-node", type=int, default=None, help="devices per node (default: the preset's, at most --devices)")
    p.add_argument("--device-type", default="h100", help="a100-40gb, a100-80gb, h100, h200, cpu, or a spec file from `shardwise calibrate`")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default: 4 x devices)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None, help="compute precision (default: bf16 on GPUs, fp32 on CPUs)")
    p.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd", "sgd_nomomentum"))
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory kept free (default 0.1)")
    p.add_argument("--top", type=int, default=5, help="how many plans to show")
    p.add_argument("--fixed", default=None, help="evaluate this plan instead of searching, e.g. dp=8,tp=8,pp=2,zero=1")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from shardwise.layout import Plan
    from shardwise.plan.cost import StatePolicy
    from shardwise.plan.planner import cluster_of, spec_from_text, stats_of
    from shardwise.plan.search import SearchOptions, evaluate, search
    from shardwise.plan.stats import transformer_stats

    if args.devices is None or args.devices < 1:
        raise ConfigError(f"--devices {args.devices} must be a positive integer", hint="e.g. --devices 8")
    if args.devices_per_node is not None and args.devices_per_node < 1:
        raise ConfigError(f"--devices-per-node {args.devices_per_node} must be a positive integer", hint="e.g. --devices-per-node 8")
    if args.top < 1:
        raise ConfigError(f"--top {args.top} must be at least 1")
    if args.seq is not None and args.seq < 1:
        raise ConfigError(f"--seq {args.seq} must be a positive integer")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom {args.headroom} must lie in [0, 1)", hint="e.g. --headroom 0.1")
    if _is_spec_file(args.device_type):
        check_input_file(args.device_type, option="--device-type")
    cluster = cluster_of(args.device_type, world_size=args.devices, devices_per_node=args.devices_per_node)
    if args.model_spec:
        stats = transformer_stats(spec_from_text(_model_spec_text(args.model_spec)), seq=args.seq)
    elif args.script:
        check_input_file(args.script, option="--script")
        from shardwise.models.measure import stats_from_script  # torch: only for a model given as code

        stats = stats_from_script(args.script, seq=args.seq)
    else:
        stats = stats_of(args.model, seq=args.seq)
    global_batch = args.global_batch if args.global_batch is not None else 4 * args.devices
    if global_batch < 1:
        raise ConfigError(f"--global-batch {global_batch} must be a positive integer")
    precision = args.precision or ("fp32" if cluster.device_type == "cpu" else "bf16")
    options = SearchOptions(precision=precision, headroom=args.headroom, top=args.top,
                            policy=StatePolicy.torch(precision, args.optimizer))
    if args.fixed:
        fixed = Plan.parse(args.fixed)
        if fixed.precision != precision and "precision" not in args.fixed:
            fixed = Plan.from_dict({**fixed.to_dict(), "precision": precision})
        estimates = [evaluate(stats, cluster, fixed, global_batch=global_batch, options=options)]
        explanation = "fixed plan" + ("" if estimates[0].fits else " (does NOT fit in memory)")
    else:
        result = search(stats, cluster, global_batch=global_batch, options=options)
        if not result.plans:
            raise result.no_fit_error()
        estimates, explanation = result.plans, result.explanation
    if args.json:
        print(json.dumps({"model": stats.name, "params": stats.params_total, "devices": cluster.devices,
                          "device_type": cluster.name, "global_batch": global_batch, "seq": stats.seq,
                          "plans": [e.to_json() for e in estimates], "explanation": explanation}, indent=2))
        return 0
    print(f"{stats.name}: {stats.params_total / 1e9:.3g}B parameters, seq {stats.seq}, global batch {global_batch}, "
          f"{cluster.devices} x {cluster.name} ({cluster.devices_per_node} per node, {cluster.memory_bytes / 1e9:.0f} GB, "
          f"{100 * (1 - args.headroom):.0f}% usable), {precision}")
    print(format_table(estimates))
    print(explanation)
    return 0


def _is_spec_file(device_type: str) -> bool:
    """Whether ``--device-type`` names a file (a preset name wins, as in the planner's resolve)."""
    from shardwise.plan.cluster import ALIASES, PRESETS

    return ALIASES.get(device_type.lower(), device_type.lower()) not in PRESETS and os.path.exists(device_type)


def _model_spec_text(value: str) -> str:
    """``--model-spec`` as JSON text: the value itself when it is (or looks like) JSON, else the
    content of the file it names; a name that is no file is said to be one, not "not JSON"."""
    if value.lstrip()[:1] in ("{", "["):
        return value
    if not os.path.exists(value):
        raise ConfigError(f"--model-spec {value!r} is neither a JSON object nor an existing file",
                          hint='give inline JSON, e.g. \'{"layers": 2, "hidden": 64, "heads": 4, "vocab": 100, "seq": 32}\', or a JSON file')
    check_input_file(value, option="--model-spec")
    try:
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError:
        raise ConfigError(f"--model-spec {value!r} is not a text file", hint="give a JSON file") from None


def format_table(estimates: list) -> str:
    head = (f"{'#':>2} {'dp':>5} {'zero':>4} {'tp':>3} {'pp':>3} {'mbs':>4} {'m':>4} {'schedule':<12} {'recompute':<9} "
            f"{'mem GB':>8} {'step s':>9} {'compute':>9} {'comm':>9} {'bubble':>9} {'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6}")
    lines = [head]
    for i, e in enumerate(estimates, 1):
        p = e.plan
        dp = f"{p.dp}x{p.shard}" if p.dp > 1 and p.shard > 1 else str(p.dp_size)
        sched = (p.schedule + (f"/v{p.virtual_stages}" if p.virtual_stages > 1 else "")) if p.pp > 1 else "-"
        lines.append(f"{i:>2} {dp:>5} {p.zero:>4} {p.tp:>3} {p.pp:>3} {e.micro_batch_size:>4} {p.microbatches:>4} {sched:<12} "
                     f"{p.recompute:<9} {e.memory_total / 1e9:>8.2f} {e.step_time_s:>9.4g} {e.time['compute']:>9.3g} "
                     f"{e.time['communication']:>9.3g} {e.time['bubble']:>9.3g} {e.tokens_per_s:>10.4g} "
                     f"{e.tflops_per_device:>8.3g} {100 * e.mfu:>5.1f}%")
    return "\n".join(lines)
