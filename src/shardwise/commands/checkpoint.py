"""``shardwise checkpoint``: inspect a checkpoint directory, consolidate one into safetensors."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  shardwise checkpoint inspect runs/ckpt                  steps, complete or not, plan, tensors
  shardwise checkpoint inspect runs/ckpt --step 400 --no-tensors
  shardwise checkpoint consolidate runs/ckpt model.safetensors   full weights of the newest step
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect or consolidate sharded checkpoints",
                       description="Inspect sharded checkpoints or consolidate one into a single safetensors file.",
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=type(p))
    ins = actions.add_parser("inspect", help="list steps, completeness, plan, tensors and sizes")
    ins.add_argument("dir", help="checkpoint directory (the one holding step_* directories)")
    ins.add_argument("--step", type=int, default=None, help="show the tensors of this step (default: newest complete)")
    ins.add_argument("--no-tensors", action="store_true", help="list the steps only")
    ins.add_argument("--verify", choices=["none", "size", "checksum"], default="checksum", help="how thoroughly to check files")
    ins.set_defaults(func=_inspect)
    con = actions.add_parser("consolidate", help="write the full model weights to one safetensors file")
    con.add_argument("dir", help="checkpoint directory, or one step_* directory")
    con.add_argument("out", help="output .safetensors path")
    con.add_argument("--step", type=int, default=None, help="step to consolidate (default: newest complete)")
    con.set_defaults(func=_consolidate)


def _inspect(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.inspect import report

    print(report(args.dir, step=args.step, show_tensors=not args.no_tensors, verify=args.verify))
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from shardwise.checkpoint.consolidate import consolidate

    shapes = consolidate(args.dir, args.out, step=args.step)
    print(f"wrote {len(shapes)} tensors to {args.out}")
    return 0
