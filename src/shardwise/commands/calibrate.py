"""``shardwise calibrate``: measure this machine and save a cluster spec for ``shardwise plan``."""

from __future__ import annotations

import argparse
import math
import os

from shardwise.config import check_output_file
from shardwise.errors import ConfigError

EXAMPLES = """examples:
  shardwise calibrate --nproc 4 --out cluster.json
  shardwise plan --model gpt --devices 4 --device-type cluster.json
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure matmul throughput and collective bandwidth; write a cluster spec",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="local processes (default: GPUs, else 2)")
    p.add_argument(
        "--out", default="cluster.json", help="where to write the spec (JSON); it is also cached for plan='auto'"
    )
    p.add_argument("--max-size-mb", type=float, default=16.0, help="largest collective message")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions per size (median)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a first look in a fraction of the time: the same measurements at fewer sizes (the smaller matmuls, "
        "the two narrowest transformer layers), each in one short window, so lower peaks, noisier figures and a "
        "shorter table for the planner",
    )
    p.add_argument("--name", default=None, help="name stored in the spec")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import torch

    from shardwise.calibrate.calibration import DEFAULT_SIZES, calibrate

    nproc = args.nproc if args.nproc is not None else (torch.cuda.device_count() or 2)
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be at least 1", hint="e.g. --nproc 4")
    if args.iters < 1:
        raise ConfigError(f"--iters {args.iters} must be a positive integer", hint="e.g. --iters 10")
    if not (math.isfinite(args.max_size_mb) and args.max_size_mb > 0):
        raise ConfigError(f"--max-size-mb {args.max_size_mb:g} must be a positive number", hint="e.g. --max-size-mb 16")
    check_output_file(args.out, option="--out")  # before minutes of measuring, not after
    sizes = tuple(s for s in DEFAULT_SIZES if s <= args.max_size_mb * 2**20) or DEFAULT_SIZES[:2]
    if len(sizes) < 2:
        sizes = DEFAULT_SIZES[:2]
    print(f"calibrating with {nproc} local processes ...", flush=True)
    spec = calibrate(nproc, sizes=sizes, iters=args.iters, name=args.name, quick=args.quick)
    spec.save(args.out)
    # The same spec is what Trainer(plan="auto") reads for a job of this shape on this host.
    from shardwise.auto.machine import cache_path, save_cached
    from shardwise.runtime.settings import read_settings

    cuda = torch.cuda.is_available()
    cached = cache_path(
        read_settings(os.environ).cache_dir,
        world_size=nproc,
        device_type="cuda" if cuda else "cpu",
        threads=max(1, (os.cpu_count() or 1) // nproc),
        device_name=torch.cuda.get_device_name(0) if cuda else "",
    )
    save_cached(spec, cached)
    flops = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in spec.peak_flops.items())
    print(f"matmul per process: {flops}")
    print(f"memory bandwidth per process: {spec.memory_bw / 1e9:.2f} GB/s")
    print(
        f"all-reduce: latency {spec.intra_latency_s * 1e6:.1f} us per step, bus bandwidth {spec.intra_bw / 1e9:.3f} "
        "GB/s"
    )
    print(
        f"fixed cost per layer forward + backward: tensor parallel {spec.tp_layer_overhead_s * 1e3:.2f} ms, "
        f"FSDP unit {spec.zero3_unit_overhead_s * 1e3:.2f} ms (ZeRO-3) / {spec.zero2_unit_overhead_s * 1e3:.2f} ms "
        "(ZeRO-2)"
    )
    print(
        f"pipeline slot {spec.pp_microbatch_overhead_s * 1e3:.2f} ms; Adam {spec.optimizer_tensor_s * 1e6:.0f} us per "
        "tensor "
        f"({spec.optimizer_dtensor_tensor_s * 1e6:.0f} us per DTensor) + {spec.optimizer_param_s * 1e9:.2f} ns per "
        "element"
    )
    layer = spec.measurements.get("block_flops", {})
    for precision, table in layer.items():
        print(
            f"transformer layer ({precision}, fwd + bwd): "
            + ", ".join(f"{float(v) / 1e9:.1f}" for v in table.values())
            + " GFLOP/s by width"
        )
    print(f"oversubscription (a lone process vs all busy): {spec.oversubscription:.2f}")
    print(f"memory per process: {spec.memory_bytes / 2**30:.1f} GiB")
    print(f"wrote {args.out}; use it with: shardwise plan --device-type {args.out} --devices {nproc} ...")
    print(f"cached as {cached}: Trainer(plan='auto') with {nproc} local processes on this host plans with it")
    return 0
