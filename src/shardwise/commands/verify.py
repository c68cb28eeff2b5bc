"""``shardwise verify``: prove a parallel layout equals one process on your model, before training.

Trains the built-in GPT (or the model of ``--script``) for ``--steps`` steps under ``--plan`` on
``plan.world_size`` local Gloo processes and as a single process, from the same seed on the same
global batches, and prints the largest divergence of the loss, the global gradient norm and the
weights with a pass/fail verdict at ``--rtol`` (float32 tolerance by default). The engine is
:mod:`shardwise.verify.parity`.

The built-in workload's targets carry ragged ``-100`` masks (:mod:`shardwise.verify.workloads`),
and each micro-step's loss is weighted by its valid targets (``--loss-reduction tokens``, the
default), as ``Trainer(train=TrainOptions(loss_reduction="tokens"))`` does; ``--loss-reduction samples`` weighs every
micro-step the same, for per-sample losses (the built-in workload then has no masked targets).

``--nproc N`` fills in what the plan leaves out for a world of ``N`` processes, with the same rules as
``shardwise train`` and the Trainer (:meth:`shardwise.layout.Plan.parse`: the unnamed data-parallel
degree takes the rest, ``zero=N`` without ``shard`` shards over all data-parallel ranks, a pipeline
gets one microbatch per stage); without it the plan's own degrees set the world size.

Bad input (a plan that does not fit the model, a batch that does not split) fails as one line
before any process starts.
"""

from __future__ import annotations

import argparse
import math

from shardwise.config import check_input_file
from shardwise.errors import ConfigError
from shardwise.layout import Plan

EXAMPLES = """examples:
  shardwise verify --plan dp=2,tp=2
  shardwise verify --plan zero=3 --nproc 4                  # = zero=3,shard=4
  shardwise verify --plan zero=3,shard=4 --steps 20
  shardwise verify --plan dp=2,pp=2,microbatches=2           # pipeline stages: norm and weights gathered over pp
  shardwise verify --plan tp=2,sp --script my_model.py     # defines build_model(seed), make_batch(step, size)
  shardwise verify --plan dp=2,cp=2                         # context parallel: zig-zag chunks of each sequence
  shardwise verify --plan dp=2,ep=2 --experts 4             # expert parallel on the built-in MoE GPT
  shardwise verify --plan dp=2 --accumulation 2 --loss-reduction samples   # per-sample weighting, targets unmasked
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check that a parallel plan trains exactly like one process", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True, help='the layout, e.g. "dp=2,tp=2" or "zero=3,shard=4"')
    p.add_argument(
        "--nproc", type=int, default=None, help="processes: fill in the degrees the plan leaves out for this world size"
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default %(default)s)")
    p.add_argument(
        "--script", default=None, help="a Python file with build_model(seed) and make_batch(step, size) [and loss_fn]"
    )
    p.add_argument(
        "--experts", type=int, default=0, help="the built-in GPT with this many experts per MoE layer (0: dense)"
    )
    p.add_argument("--top-k", type=int, default=2, help="experts per token of the built-in MoE GPT")
    p.add_argument("--global-batch", type=int, default=8, help="samples per step, split over the data-parallel ranks")
    p.add_argument("--accumulation", type=int, default=1, help="micro-steps per optimizer step on each rank")
    p.add_argument(
        "--optimizer",
        choices=["sgd", "adamw"],
        default=None,
        help="sgd (with momentum; rounding differences stay float32-sized) or adamw (amplifies them for near-zero "
        "gradients); default: the --script's make_optimizer(params) if it has one, else sgd",
    )
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 0.1 for sgd, 1e-3 for adamw)")
    p.add_argument(
        "--meta-init", action="store_true", help="build on the meta device and materialize only local shards"
    )
    p.add_argument("--loss-parallel", action="store_true", help="keep the LM head's logits vocabulary-sharded (TP)")
    p.add_argument(
        "--loss-reduction",
        choices=["tokens", "samples"],
        default="tokens",
        help="weigh each micro-step's loss by its valid targets (tokens; the built-in workload's targets are "
        "ragged-masked) or equally (samples; for per-sample losses, targets unmasked) (default %(default)s)",
    )
    p.add_argument("--rtol", type=float, default=1e-5, help="pass if every relative divergence is at most this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the processes are given up")
    p.set_defaults(func=_main)


def _check_numbers(args: argparse.Namespace) -> None:
    """The numeric flags, before any process starts: a zero batch or accumulation would fail inside
    the workers, a NaN tolerance would make every comparison fail."""
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be at least 1", hint="for example --steps 20")
    if args.experts < 0:
        raise ConfigError(f"--experts {args.experts} must be 0 (dense) or a positive number of experts")
    for flag, value in (("--global-batch", args.global_batch), ("--accumulation", args.accumulation)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be a positive integer")
    for flag, value in (("--rtol", args.rtol), ("--lr", args.lr)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{flag} {value:g} must be a non-negative number")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ConfigError(f"--timeout {args.timeout:g} must be a positive number of seconds")


def _main(args: argparse.Namespace) -> int:
    import torch

    from shardwise.launch.inprocess import launch
    from shardwise.parallel.parallelize import validate
    from shardwise.parallel.tp.styles import TPOptions
    from shardwise.verify.parity import GPTWorkload, Run, ScriptWorkload, Training, parity_worker

    if args.nproc is not None and args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc} must be a positive integer", hint="e.g. --nproc 4")
    plan = Plan.parse(args.plan, world_size=args.nproc)
    if args.nproc is not None:
        plan.check_world(args.nproc)
    _check_numbers(args)
    if args.script:
        check_input_file(args.script, option="--script")
    per_step = plan.dp_size * args.accumulation * (plan.microbatches if plan.pp_enabled else 1)
    if args.global_batch % per_step:
        pipe = f" x {plan.microbatches} pipeline microbatches" if plan.pp_enabled else ""
        raise ConfigError(
            f"--global-batch {args.global_batch} does not split into {plan.dp_size} data-parallel ranks x "
            f"{args.accumulation} micro-steps{pipe}",
            hint=f"use a multiple of {per_step}, e.g. {per_step * max(1, args.global_batch // per_step)}",
        )
    if args.script and args.experts:
        raise ConfigError("--experts configures the built-in GPT, not a --script model", hint="drop one of them")
    from dataclasses import replace

    from shardwise.verify.parity import SMALL_GPT

    masked = (
        args.loss_reduction == "tokens"
    )  # ragged masks are what token reduction is for; samples is for per-sample losses
    workload = (
        ScriptWorkload(args.script)
        if args.script
        else GPTWorkload(replace(SMALL_GPT, experts=args.experts, top_k=args.top_k), masked=masked)
    )
    # Check the plan against the model here, on the meta device: no memory, no processes.
    with torch.device("meta"):
        validate(workload.build(args.seed), plan, tp=TPOptions(loss_parallel=args.loss_parallel))
    own = (
        workload.optimizer() if args.script and args.optimizer is None else None
    )  # the user's optimizer, as training runs it
    name = args.optimizer or "sgd"
    training = Training(
        steps=args.steps,
        global_batch=args.global_batch,
        seed=args.seed,
        optimizer=own or name,
        lr=args.lr if args.lr is not None else (0.1 if name == "sgd" else 1e-3),
        loss_reduction=args.loss_reduction,
    )
    run = Run(str(plan), accumulation=args.accumulation, meta_init=args.meta_init, loss_parallel=args.loss_parallel)
    print(
        f"verify: {plan.world_size} process(es), plan {plan}, {args.steps} steps, global batch {args.global_batch}, "
        + ("the script's make_optimizer" if own else f"{name} lr {training.lr:g}")
        + f", loss_reduction={args.loss_reduction}"
        + ("" if args.script else f" ({'targets with ragged -100 masks' if masked else 'every target valid'})"),
        flush=True,
    )
    reports = launch(
        parity_worker, nprocs=plan.world_size, args=(workload, [run], training), backend="gloo", timeout_s=args.timeout
    )
    report = reports[0][0]
    print(report.format(args.rtol))
    disagree = [rank for rank, r in enumerate(reports) if r[0].passed(args.rtol) != report.passed(args.rtol)]
    if disagree:
        print(f"  note: ranks {disagree} reached a different verdict than rank 0")
    return 0 if report.passed(args.rtol) and not disagree else 1
