"""``shardwise plan``: rank the parallel layouts of a model on a cluster (a dry run: no devices used).

``--fixed KEYS`` fixes only the plan keys it names and searches the others (``--fixed
dp=24,tp=8,pp=8`` chooses the ZeRO layout, microbatches, schedule, recomputation and shardwise's
runtime options: 16-bit parameters, the chunked loss, sharded accumulation); ``--explain`` names
the dominant terms of each plan's step, the runtime option that made the difference and, with
``--fixed``, how the free search compares; ``--precision fp8`` plans torchao's FP8 linears; ``--params N`` with
``--memory-convention zero-paper`` prints the model-state memory of every ZeRO stage as the ZeRO paper counts it
(its table 1).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from shardwise.commands.plan_output import print_json, print_text, states_table
from shardwise.config import check_input_file
from shardwise.errors import ConfigError

EXAMPLES = (
    """examples:
  shardwise plan --model gpt --devices 4 --device-type cpu
  shardwise plan --model-spec '{"layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq": 2048}' \\
                 --devices 1024 --devices-per-node 8 --device-type h100 --global-batch 1536
  shardwise plan --model gpt3-13b --devices 64 --device-type a100-80gb --fixed dp=8,tp=8 --json
  shardwise plan --model gpt3-175b --devices 1536 --device-type a100-80gb --global-batch 2304 """
    """--fixed dp=24,tp=8,pp=8 --explain
  shardwise plan --params 7.5e9 --devices 64 --memory-convention zero-paper
  shardwise plan --script my_model.py --devices 8 --device-type calibrated.json
  shardwise plan --model-script examples/hf_verify_script.py --devices 8 --device-type h100
  shardwise plan --model.hf examples/configs/llama-7b.json --devices 64 --device-type h100 --global-batch 512
"""
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="choose DP/ZeRO/TP/PP degrees, microbatches and recomputation for a model",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_arguments(p)
    _cluster_arguments(p)
    _precision_arguments(p)
    _search_arguments(p)
    p.set_defaults(func=_main)


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """The model, given one way of six (a preset, a shape, a script, a Hugging Face config, a
    parameter count)."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="built-in model: gpt (shardwise's GPT), gpt2, gpt3-1.3b, gpt3-13b, gpt3-175b")
    src.add_argument(
        "--model-spec",
        help='transformer shape as JSON (or a JSON file): {"layers", "hidden", "heads", "vocab", "seq"}'
        ' and optional "ffn", "kv_heads", "tied_embeddings", "gated_mlp"',
    )
    src.add_argument("--script", help="Python file defining MODEL_SPEC, or build_model() and example_input(device)")
    src.add_argument(
        "--model-script",
        help="your model as a `shardwise verify --script` file: build_model(seed) and "
        "make_batch(step, size); built on meta, sized by its first sample like Trainer(plan='auto')",
    )
    src.add_argument(
        "--model.hf",
        dest="model_hf",
        metavar="DIR",
        help="a Hugging Face model directory (or its config.json): the shape its config says, "
        "as Trainer(plan='auto') reads it",
    )
    src.add_argument(
        "--params",
        type=float,
        help="a model given by its parameter count alone: print the model-state memory of each ZeRO stage",
    )


def _cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The devices, their type and the batch and sequence they run."""
    p.add_argument("--devices", type=int, required=True, help="number of devices (processes)")
    p.add_argument(
        "--devices-per-node", type=int, default=None, help="devices per node (default: the preset's, at most --devices)"
    )
    p.add_argument(
        "--device-type",
        default="h100",
        help="a100-40gb, a100-80gb, h100, h200, cpu, or a spec file from `shardwise calibrate`",
    )
    p.add_argument("--global-batch", type=int, default=None, help="sequences per optimizer step (default: 4 x devices)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")


def _precision_arguments(p: argparse.ArgumentParser) -> None:
    """Precision, its policy, recomputation's kept tensors and the bytes of the model states."""
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16", "fp8"),
        default=None,
        help="compute precision (default: bf16 on GPUs, fp32 on CPUs); fp8: torchao's float8 linears on a device with "
        "FP8 tensor cores (h100, h200, h800)",
    )
    p.add_argument("--precision-policy", choices=("autocast", "16bit"), default="autocast",
                   help="how mixed precision runs: autocast over fp32 parameters (shardwise's Trainer, the default) or "
                        "16-bit parameters and activations (Megatron-LM, torchtitan, llm-foundry)")
    p.add_argument(
        "--selective",
        choices=("matmuls", "op", "attention", "layer"),
        default=None,
        help="what recompute=selective keeps: matmuls (shardwise's policy; default with autocast), op (torchtitan's "
        "per-op SAC), attention (Korthikanti et al.: all but the attention core; default with 16bit), layer (every "
        "second block recomputed)",
    )
    p.add_argument(
        "--memory-convention",
        choices=("torch", "zero-paper", "megatron"),
        default="torch",
        help="bytes per parameter of the model states: torch (fp32 master = parameter, 4+4+8 with Adam; the default), "
        "zero-paper (2+2+12, the ZeRO paper's table 1), megatron (2+4+12)",
    )


def _search_arguments(p: argparse.ArgumentParser) -> None:
    """The optimizer and adapters the plans carry, the search's options and the output."""
    p.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "muon", "sgd", "sgd_nomomentum"),
                   help="the optimizer whose states (and, for muon, Newton-Schulz and its all-to-alls) the plans carry")
    p.add_argument("--lora.r", dest="lora_r", type=int, default=0, metavar="R",
                   help="LoRA adapters of rank R on every projection of a frozen base (0: full fine-tuning)")
    p.add_argument("--lora.base", dest="lora_base", choices=("fp32", "nf4"), default="fp32",
                   help="how the frozen base is stored: fp32, or nf4 (QLoRA's 4-bit base)")
    p.add_argument(
        "--runtime-options",
        dest="runtime_options",
        choices=("speed", "memory"),
        default="speed",
        help="when the search turns shardwise's runtime options on: wherever they help (speed, the default), or only "
        "where a plan does not fit without them (memory: e.g. to price a --fixed layout without shardwise's speed-ups)",
    )
    p.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory kept free (default 0.1)")
    p.add_argument("--top", type=int, default=None, help="how many plans to show (default 5; 1 with --fixed)")
    p.add_argument(
        "--fixed",
        default=None,
        help="fix these plan keys and search the rest, e.g. dp=24,tp=8,pp=8 (a complete plan: evaluate it)",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="name the dominant terms of each plan's step (with --fixed: compare with the free search)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _check(args: argparse.Namespace) -> None:
    if args.devices is None or args.devices < 1:
        raise ConfigError(f"--devices {args.devices} must be a positive integer", hint="e.g. --devices 8")
    if args.devices_per_node is not None and args.devices_per_node < 1:
        raise ConfigError(
            f"--devices-per-node {args.devices_per_node} must be a positive integer", hint="e.g. --devices-per-node 8"
        )
    if args.top is not None and args.top < 1:
        raise ConfigError(f"--top {args.top} must be at least 1")
    if args.seq is not None and args.seq < 1:
        raise ConfigError(f"--seq {args.seq} must be a positive integer")
    if not 0 <= args.headroom < 1:
        raise ConfigError(f"--headroom {args.headroom} must lie in [0, 1)", hint="e.g. --headroom 0.1")


def _main(args: argparse.Namespace) -> int:
    _check(args)
    if args.params is not None:
        return states_table(args)
    from shardwise.plan.planner import cluster_of

    if _is_spec_file(args.device_type):
        check_input_file(args.device_type, option="--device-type")
    cluster = cluster_of(args.device_type, world_size=args.devices, devices_per_node=args.devices_per_node)
    stats = _model_stats(args)
    global_batch = args.global_batch if args.global_batch is not None else 4 * args.devices
    if global_batch < 1:
        raise ConfigError(f"--global-batch {global_batch} must be a positive integer")
    precision = args.precision or ("fp32" if cluster.device_type == "cpu" else "bf16")
    if precision == "fp8" and "fp8" not in cluster.peak_flops:
        raise ConfigError(f"--precision fp8 needs FP8 tensor cores, which {cluster.name} does not have",
                          hint="use --device-type h100, h200 or h800 (or a spec with an fp8 peak), or --precision bf16")
    options = _search_options(args, stats, precision)
    found = _ranked(args, stats, cluster, global_batch, options)
    if args.json:
        return print_json(args, found)
    return print_text(args, found)


def _model_stats(args: argparse.Namespace) -> Any:
    """The planner's statistics of the model the flags name (a spec, a script, a Hugging Face
    config, a preset), with LoRA adapters when ``--lora.r`` asks for them."""
    from shardwise.plan.planner import spec_from_text, stats_of
    from shardwise.plan.stats import transformer_stats

    if args.model_spec:
        shape, gated = spec_from_text(_model_spec_text(args.model_spec))
        stats = transformer_stats(shape, seq=args.seq, gated_mlp=gated)
    elif args.script:
        check_input_file(args.script, option="--script")
        from shardwise.auto.measure import stats_from_script  # torch: only for a model given as code

        stats = stats_from_script(args.script, seq=args.seq)
    elif args.model_script:
        check_input_file(args.model_script, option="--model-script")
        from shardwise.auto.measure import stats_from_model_script  # torch: only for a model given as code

        stats = stats_from_model_script(args.model_script, seq=args.seq)
    elif args.model_hf:
        from shardwise.models.hf import (
            read_config,
            stats_of_config,
        )  # the same reading as Trainer(Pretrained(DIR), plan="auto")

        stats = stats_of_config(read_config(args.model_hf), seq=args.seq)
    else:
        stats = stats_of(args.model, seq=args.seq)
    if args.lora_r:  # adapters on every projection of a frozen base (shardwise.plan.adapters)
        from shardwise.plan.adapters import with_lora

        stats = with_lora(stats, r=args.lora_r, base=args.lora_base)
    elif args.lora_base != "fp32":
        raise ConfigError(
            "--lora.base nf4 is QLoRA's 4-bit base under adapters", hint="add --lora.r 16 (or another rank)"
        )
    return stats


def _search_options(args: argparse.Namespace, stats: Any, precision: str) -> Any:
    """The search's options from the flags. shardwise's runtime options are searched for shardwise's
    runtime; a framework's 16-bit policy has its own (16-bit parameters, a fused loss, sharded
    accumulation) always on."""
    from dataclasses import replace

    from shardwise.plan.options import RUNTIME_OPTIONS
    from shardwise.plan.policy import RunPolicy
    from shardwise.plan.search import SearchOptions

    run = RunPolicy.named(args.precision_policy)
    if args.selective:
        run = replace(run, selective=args.selective)
    return SearchOptions(precision=precision, headroom=args.headroom, top=args.top or (1 if args.fixed else 5), run=run,
                         policy=_policy(args, stats, precision),
                         runtime_options=RUNTIME_OPTIONS if args.precision_policy == "autocast" else (),
                         options_for_memory=args.runtime_options == "memory")


@dataclass(frozen=True)
class _Ranked:
    """What the command prints: the ranked plans, why, and (``--fixed --explain``) the best plan
    of a free search."""

    stats: Any
    cluster: Any
    global_batch: int
    options: Any
    estimates: list[Any]
    explanation: str
    free: Any = None

    def notes(self, e: Any, headroom: float) -> list[str]:
        """What each runtime option the plan turns on did for it."""
        from shardwise.plan.cost import estimate
        from shardwise.plan.options import option_notes

        return option_notes(
            e,
            lambda plan: estimate(
                self.stats,
                self.cluster,
                plan,
                global_batch=self.global_batch,
                policy=self.options.policy,
                headroom=headroom,
                run=self.options.run,
            ),
        )


def _ranked(args: argparse.Namespace, stats: Any, cluster: Any, global_batch: int, options: Any) -> _Ranked:
    """The search: free, or constrained by ``--fixed`` (then the fastest plan of those named even
    when none fits, said so)."""
    from shardwise.commands.plan_lines import framework_line
    from dataclasses import replace

    from shardwise.plan.search import candidates, fixed_options, search
    from shardwise.plan.support import runtime_conflict

    if not args.fixed:
        result = search(stats, cluster, global_batch=global_batch, options=options)
        if not result.plans:
            raise result.no_fit_error()
        return _Ranked(stats, cluster, global_batch, options, result.plans, result.explanation)
    constrained = fixed_options(args.fixed, options)
    if constrained.precision != options.precision:  # precision=... named in --fixed
        constrained = replace(constrained, policy=_policy(args, stats, constrained.precision))
    result = search(stats, cluster, global_batch=global_batch, options=constrained)
    if result.plans:
        estimates = result.plans
        explanation = f"--fixed {args.fixed}: the best of the plans that keep these keys" + (
            f"; {result.explanation}" if len(estimates) > 1 else "")
    else:
        every = candidates(stats, cluster, global_batch=global_batch, options=constrained)
        if not every:
            raise ConfigError(
                f"--fixed {args.fixed} names no valid plan for {cluster.devices} devices "
                f"and global batch {global_batch}",
                hint="the named degrees must multiply to a divisor of --devices, and dp must divide the global batch",
            )
        estimates = every[:options.top]
        best = min(every, key=lambda e: e.memory_total)
        explanation = (
            f"--fixed {args.fixed}: no such plan fits (does NOT fit in memory: the least memory any of them "
            f"needs is {best.memory_total / 1e9:.2f} GB, above the {best.memory_limit / 1e9:.2f} GB usable); "
            "the fastest is shown"
        )
    if args.precision_policy == "autocast":  # the same layout as another framework runs it, beside shardwise's
        explanation += "\n" + framework_line(stats, cluster, global_batch, constrained, estimates[0])
    conflict = runtime_conflict(estimates[0].plan)
    if conflict is not None:  # the cost model prices it (e.g. Megatron's ZeRO-1 x TP x PP); shardwise cannot run it
        explanation += f"; note: shardwise's parallel layer cannot run it ({conflict})"
    free = None
    if args.explain:
        found = search(stats, cluster, global_batch=global_batch, options=replace(options, top=1))
        free = found.plans[0] if found.plans else None
    return _Ranked(stats, cluster, global_batch, options, estimates, explanation, free)



def _policy(args: argparse.Namespace, stats: Any, precision: str) -> Any:
    """The state policy of ``--memory-convention`` and ``--optimizer``; muon: its one momentum on the
    matrices and Adam's two moments on the rest, blended over the model (shardwise.plan.muon)."""
    from dataclasses import replace

    from shardwise.plan.memory import StatePolicy

    policy = StatePolicy.named(args.memory_convention, precision=precision, optimizer=args.optimizer)
    if args.optimizer != "muon":
        return policy
    from shardwise.plan.muon import state_bytes_per_param

    return replace(policy, optimizer=state_bytes_per_param(stats))


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
        raise ConfigError(
            f"--model-spec {value!r} is neither a JSON object nor an existing file",
            hint='give inline JSON, e.g. \'{"layers": 2, "hidden": 64, "heads": 4, "vocab": 100, "seq": 32}\', '
            "or a JSON file",
        )
    check_input_file(value, option="--model-spec")
    try:
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError:
        raise ConfigError(f"--model-spec {value!r} is not a text file", hint="give a JSON file") from None
