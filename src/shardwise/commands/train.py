"""``shardwise train``: the main job — a character-level GPT on the standard library's own source.

The command resolves the configuration (defaults < ``--config`` TOML < command line), checks it
and the plan against the number of processes *before* starting anything (so a bad key or value
is one line and exit code 2), prints the plan, writes the resolved configuration to
``<runs_dir>/<name>/config.toml`` and starts the workers (:mod:`shardwise.jobs.train`) with
shardwise's elastic launcher — or runs the job in this process with ``--nproc 1``. At the end it
prints the validation loss next to the corpus's unigram entropy, and a generated sample.

A run cut short says so instead: pre-empted (SIGTERM or SIGUSR1, to this command or to a worker:
the workers saved a checkpoint) at step N, where the checkpoint is, the command that resumes it,
and the exit status ``128 + signal`` (:mod:`shardwise.jobs.outcome`). ``--max-restarts N``
restarts the workers after a failure; a restarted attempt resumes from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import typing
from dataclasses import fields

from shardwise.config import TrainJobConfig, load_config, section_fields, to_toml
from shardwise.errors import ConfigError, ShardwiseError, StoppedBySignal
from shardwise.layout import Plan

EXAMPLES = (
    """examples:
  shardwise train                                   defaults: GPT on the stdlib source, all local cores
  shardwise train --nproc 1 --max-steps 100         one process, a short run
  shardwise train --model.layers=6 --model.hidden=192 --train.lr=2e-3
  shardwise train --config run.toml --train.precision=bf16
  shardwise train --plan auto                       the planner picks the layout
  shardwise train --model.hf DIR --data.files 'data/**/*.txt'   fine-tune a Hugging Face model on local text
  shardwise train --model.hf DIR --data.files 'd/*.txt' --lora.r 16 [--lora.base nf4]"""
    """   LoRA (QLoRA) adapters on a frozen base
  shardwise train --print-config > run.toml         write the resolved configuration, start nothing
  shardwise train --max-restarts 2                  restart after a crash, resuming from the newest checkpoint
  shardwise train --log.tracker mlflow                also log to MLflow (its default store: ./mlflow.db)
  shardwise train --log.tracker mlflow --log.tracking_uri file:///abs/mlruns"""
    """   a file store (MLflow 3's opt-in is set for the run)
  shardwise train --log.tracker wandb --log.wandb_mode offline   W&B without an account: files under <run dir>/wandb

precedence: defaults < the --config TOML file < the command line (the shortcut flags --nproc,
--max-steps, --plan and --resume are the same as parallel.nproc, train.max_steps, parallel.plan and
checkpoint.resume and are applied last). In TOML each section is a table:  [train]  lr = 2e-3
logs: <run.runs_dir>/<run.name>/ holds metrics.csv, curves.png, config.toml, summary.json, sample.txt;
--log.tracker mlflow|wandb also sends the metrics, this configuration and the plan to a tracker (a resume continues """
    """its run)
pre-emption: SIGTERM or SIGUSR1 saves a checkpoint at the next step and exits 128 + signal (143, 138),
printing the command that resumes the run
multi-node: shardwise run --nnodes 2 ... -m shardwise.jobs.train --config run.toml
"""
)

_SHORTCUTS = {
    "nproc": "parallel.nproc",
    "max_steps": "train.max_steps",
    "plan": "parallel.plan",
    "resume": "checkpoint.resume",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        usage="shardwise train [-h] [--config FILE.toml] [--nproc N] [--max-steps N] [--plan PLAN] [--resume auto] "
        "[--print-config]\n"
        "                       [--section.key=VALUE ...]",
        help="train the built-in GPT on the standard library's source (the main job)",
        description="Train a character-level GPT on the Python standard library's own source text, "
        "data parallel over the local processes, and report the validation loss against the corpus's unigram entropy.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config", default=None, metavar="FILE.toml", help="configuration file (TOML, one table per section)"
    )
    p.add_argument("--nproc", default=None, metavar="N", help="local processes: a number or 'auto' (= parallel.nproc)")
    p.add_argument("--max-steps", default=None, metavar="N", help="optimizer steps (= train.max_steps)")
    p.add_argument(
        "--plan",
        default=None,
        metavar="PLAN",
        help="parallel plan: dp, auto (the planner picks), or e.g. dp=2,tp=2 (= parallel.plan)",
    )
    p.add_argument("--resume", default=None, choices=["auto", "never"],
                   help="'auto': continue from the newest complete checkpoint of --run.name (= checkpoint.resume)")
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="hang watchdog: a collective stuck this long stops every rank with a report (default 300; 0 disables)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart the processes up to N times after a failure; a restart resumes from the newest complete "
        "checkpoint",
    )
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration as TOML and exit")
    _add_config_keys(p)
    p.set_defaults(func=_main)


def _add_config_keys(parser: argparse.ArgumentParser) -> None:
    """One ``--section.key`` option per configuration field, with its default and help."""
    sections = typing.get_type_hints(TrainJobConfig)
    for section in fields(TrainJobConfig):
        cls = sections[section.name]
        group = parser.add_argument_group(f"[{section.name}] configuration (--{section.name}.KEY=VALUE)")
        hints = typing.get_type_hints(cls)
        for f in section_fields(TrainJobConfig, section.name):
            choices = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is typing.Literal else ()
            extra = f" ({'|'.join(choices)})" if choices else ""
            group.add_argument(
                f"--{section.name}.{f.name}",
                dest=f"cfg:{section.name}.{f.name}",
                default=argparse.SUPPRESS,
                metavar="V",
                help=f"{f.metadata.get('help', '')}{extra} [default: {f.default!r}]",
            )


def resolve_config(args: argparse.Namespace) -> TrainJobConfig:
    overrides = [f"{key[4:]}={value}" for key, value in vars(args).items() if key.startswith("cfg:")]
    shortcuts = {dotted: getattr(args, flag) for flag, dotted in _SHORTCUTS.items() if getattr(args, flag) is not None}
    return load_config(path=args.config, overrides=overrides, values=shortcuts)


def nproc_of(config: TrainJobConfig) -> int:
    from shardwise.launch.options import auto_nproc

    value = config.parallel.nproc.strip().lower()
    if value == "auto":
        return auto_nproc(os.environ)
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"config key 'parallel.nproc': {config.parallel.nproc!r} is not a positive integer or 'auto'",
                          hint="for example --nproc 2")
    return int(value)


def job_plan(config: TrainJobConfig, nproc: int) -> Plan | None:
    """The plan the job runs on ``nproc`` processes, resolved once before anything starts (None for
    ``auto``: the Trainer plans): the degrees the plan leaves out are filled in
    (:func:`shardwise.resolve.resolve_plan`), and the global batch must split over its data-parallel
    ranks and accumulation steps. Bad input is one line naming the fix."""
    from shardwise.jobs.summary import precision_override
    from shardwise.resolve import resolve_plan

    text = config.parallel.plan_text()  # with parallel.params16, .chunked_loss, .sharded_accumulation
    if text.lower() == "auto":
        return None
    plan = resolve_plan(text, nproc, precision=precision_override(config.train.precision))
    if plan.precision == "fp8" and importlib.util.find_spec("torchao") is None:  # before any process starts
        raise ConfigError("precision=fp8 needs torchao (the float8 training API)",
                          hint="pip install 'shardwise[fp8]' (torchao 0.18), or use --train.precision=bf16")
    if (
        plan.tp_enabled and config.model.hf and config.lora.r and config.lora.base == "nf4"
    ):  # the workers would refuse it
        raise ConfigError(
            f"plan {plan}: tp cannot split QLoRA's 4-bit NF4 base (lora.base=nf4: torchao splits NF4 tensors along "
            "rows only, and a row-wise layer needs its columns split)",
            hint="use zero=3 (or dp) for QLoRA, or lora.base=fp32 with tp",
        )
    if config.train.global_batch_size % (plan.dp_size * config.train.grad_accum_steps):
        raise ConfigError(
            f"config key 'train.global_batch_size': {config.train.global_batch_size} does not split into "
            f"{plan.dp_size} data-parallel ranks x {config.train.grad_accum_steps} accumulation steps",
            hint=f"use a multiple of {plan.dp_size * config.train.grad_accum_steps}",
        )
    return plan


def _main(args: argparse.Namespace) -> int:
    import time
    from dataclasses import replace

    from shardwise.jobs.outcome import exit_status, newest_checkpoint, read_summary, resume_command
    from shardwise.jobs.summary import (
        check_data_options,
        check_fresh_start,
        check_run_dir,
        default_run_name,
        format_summary,
    )
    from shardwise.jobs.tracking import check_tracker
    from shardwise.launch.options import hang_timeout_env

    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts} is negative", hint="use 0 (no restarts) or more")
    config = resolve_config(args)
    if args.print_config:
        print(to_toml(config), end="")
        return 0
    check_data_options(config)
    if config.model.hf:  # a missing directory, tokenizer or data file: one line, before any process starts
        from shardwise.jobs.hf_train import check_hf_job

        check_hf_job(config)
    nproc = nproc_of(config)
    hang_env = hang_timeout_env(args.hang_timeout)  # checked before anything runs, with one process too
    plan = job_plan(config, nproc)  # resolved here, once: the workers get the resolved plan ("auto": the Trainer plans)
    default_name = default_run_name().replace("gpt-stdlib", "hf") if config.model.hf else default_run_name()
    config = replace(config, run=replace(config.run, name=config.run.name or default_name),
                     parallel=replace(config.parallel, plan="auto" if plan is None else str(plan)))
    run_dir = os.path.join(config.run.runs_dir, config.run.name)
    check_run_dir(run_dir)
    if config.checkpoint.resume != "auto":
        check_fresh_start(run_dir)
    tracker_env = check_tracker(
        config.log
    )  # last of the checks: an MLflow database store is created when it is checked
    for key, value in tracker_env.items():  # MLflow 3's file-store switch, for the file store the user named
        os.environ[key] = value  # this process and (inherited) the workers
        print(f"log.tracking_uri: a file store was asked for, so {key}={value} is set for this run (MLflow 3 keeps "
              "file stores switched off by default)", flush=True)
    _announce(plan, nproc, run_dir)

    from shardwise.launch.forward import forward_for_this_process

    # From here to the exit, SIGUSR1 (Slurm's warning) is recorded and passed on, never fatal.
    forwarded = forward_for_this_process()
    started = time.time()
    stopped = _run_workers(config, nproc, max_restarts=args.max_restarts, hang_env=hang_env, forwarded=forwarded)

    resume = resume_command(run_dir, max_restarts=args.max_restarts, hang_timeout=args.hang_timeout)
    summary = read_summary(run_dir, since=started)
    if summary is None:
        if stopped is not None:  # the workers were ended before they could report
            raise StoppedBySignal(
                f"{stopped.message}; no summary from the workers; {newest_checkpoint(run_dir)}; resume with: {resume}",
                signum=stopped.signum,
            )
        raise ShardwiseError(f"the run finished without writing {os.path.join(run_dir, 'summary.json')}",
                             hint="see the workers' output above")
    print(format_summary(summary, resume))
    return exit_status(summary)


def _announce(plan: Plan | None, nproc: int, run_dir: str) -> None:
    """The plan (or that the planner chooses) and the run directory, before any process starts."""
    if plan is None:
        print(
            f"plan: auto (the planner chooses for the model on {nproc} process{'es' if nproc > 1 else ''}; printed "
            "below)",
            flush=True,
        )
    else:
        print(f"plan ({plan}, {nproc} process{'es' if nproc > 1 else ''}):")
        print("  " + plan.describe().replace("\n", "\n  "), flush=True)
    print(f"run directory: {run_dir}", flush=True)


def _run_workers(config: TrainJobConfig, nproc: int, *, max_restarts: int, hang_env: dict[str, str],
                 forwarded: typing.Any) -> StoppedBySignal | None:
    """Run the job: in this process (one process, no restarts), else the workers under torch's
    elastic agent. Returns the StoppedBySignal that ended them (None: they finished)."""
    import tempfile

    stopped = None
    if nproc == 1 and not max_restarts:  # a restart needs the elastic agent, even for one process
        from shardwise.jobs.train import run_job
        from shardwise.runtime.env import shutdown

        try:
            run_job(config)
        finally:
            shutdown()
    else:
        import dataclasses

        from shardwise.launch.options import RunOptions, resolve
        from shardwise.launch.run import run_launch

        # The workers read the resolved configuration from a file of their own; the job writes
        # <run_dir>/config.toml itself once training starts (a refused resume changes nothing).
        with tempfile.TemporaryDirectory(prefix="shardwise-train-") as tmp:
            launch_config = os.path.join(tmp, "config.toml")
            with open(launch_config, "w") as fh:
                fh.write(to_toml(config))
            options = RunOptions(script="shardwise.jobs.train", module=True, script_args=("--config", launch_config),
                                 nproc_per_node=str(nproc), max_restarts=max_restarts)
            resolved = resolve(options)
            try:
                run_launch(
                    dataclasses.replace(resolved, worker_env={**resolved.worker_env, **hang_env}), forwarded=forwarded
                )
            except StoppedBySignal as err:  # the workers' summary (below) says where they stopped
                stopped = err
    return stopped
