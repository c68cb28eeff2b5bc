"""``shardwise checkpoint``: inspect a checkpoint directory, consolidate one into safetensors, export one
as a Hugging Face model directory."""

from __future__ import annotations

import argparse

EXAMPLES = (
    """examples:
  shardwise checkpoint inspect runs/ckpt                           steps, complete or not, plan, tensors
  shardwise checkpoint inspect runs/ckpt --step 400 --no-tensors
  shardwise checkpoint consolidate runs/ckpt model.safetensors     full weights of the newest step
  shardwise checkpoint export --format hf runs/ckpt out/           config.json + safetensors shards for transformers
  shardwise checkpoint export --format peft runs/lora adapter/     a LoRA run's adapters for PeftModel.from_pretrained
  shardwise checkpoint export --format hf --merge runs/lora out/"""
    """   a LoRA run merged into its base, for plain transformers
"""
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect or consolidate sharded checkpoints",
                       description="Inspect sharded checkpoints or consolidate one into a single safetensors file.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(p))
    ins = actions.add_parser("inspect", help="list steps, completeness, plan, tensors and sizes")
    ins.add_argument("dir", help="checkpoint directory (the one holding step_* directories)")
    ins.add_argument("--step", type=int, default=None, help="show the tensors of this step (default: newest complete)")
    ins.add_argument("--no-tensors", action="store_true", help="list the steps only")
    ins.add_argument(
        "--verify", choices=["none", "size", "checksum"], default="checksum", help="how thoroughly to check files"
    )
    ins.set_defaults(func=_inspect)
    con = actions.add_parser("consolidate", help="write the full model weights to one safetensors file")
    con.add_argument("dir", help="checkpoint directory, or one step_* directory")
    con.add_argument("out", help="output .safetensors path")
    con.add_argument("--step", type=int, default=None, help="step to consolidate (default: newest complete)")
    con.set_defaults(func=_consolidate)
    exp = actions.add_parser(
        "export", help="write a checkpoint's model in another format (hf: a transformers model directory)"
    )
    exp.add_argument("dir", help="checkpoint directory, or one step_* directory")
    exp.add_argument("out", help="output directory")
    exp.add_argument(
        "--format",
        choices=["hf", "peft"],
        default="hf",
        help="hf: config.json and safetensors shards (default); peft: a LoRA run's adapter_config.json and "
        "adapter_model.safetensors",
    )
    exp.add_argument(
        "--merge",
        action="store_true",
        help="with --format hf: merge a LoRA run's adapters into its base (peft's merge_and_unload)",
    )
    exp.add_argument("--step", type=int, default=None, help="step to export (default: newest complete)")
    exp.add_argument("--model", default=None, metavar="DIR",
                     help="the model directory the run started from (default: the copy kept in the checkpoint's hf/)")
    exp.add_argument(
        "--max-shard-size", type=float, default=2.0, metavar="GB", help="largest safetensors file (default 2 GB)"
    )
    exp.set_defaults(func=_export)


def _inspect(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.inspect import report

    print(report(args.dir, step=args.step, show_tensors=not args.no_tensors, verify=args.verify))
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.consolidate import consolidate

    shapes = consolidate(args.dir, args.out, step=args.step)
    print(f"wrote {len(shapes)} tensors to {args.out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.hf_export import export_hf

    if args.format == "peft" or args.merge:
        from shardwise.checkpoint.peft_export import export_merged, export_peft
        from shardwise.errors import ConfigError

        if args.format == "peft" and args.merge:
            raise ConfigError(
                "--merge writes a full model (--format hf), not a PEFT adapter",
                hint="drop --merge, or use --format hf --merge",
            )
        if args.format == "peft":
            shapes = export_peft(args.dir, args.out, step=args.step)
            print(
                f"wrote {len(shapes)} adapter tensors and adapter_config.json to {args.out} (load it with "
                "PeftModel.from_pretrained)"
            )
            return 0
        base = export_merged(args.dir, args.out, step=args.step, model_dir=args.model)
        print(f"wrote the adapters merged into {base} to {args.out} (load it with transformers' from_pretrained)")
        return 0

    shapes = export_hf(
        args.dir, args.out, step=args.step, model_dir=args.model, max_shard_bytes=int(args.max_shard_size * 1024**3)
    )
    print(f"wrote {len(shapes)} tensors and config.json to {args.out} (load it with transformers' from_pretrained)")
    return 0
