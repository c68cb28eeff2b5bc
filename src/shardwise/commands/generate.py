"""``shardwise generate``: decode from a shardwise checkpoint or a Hugging Face directory, sharded.

The checkpoint is one of the built-in GPT job (its shape and characters kept in ``gpt/model.json``
beside the checkpoints) or of a Hugging Face model. Starts ``plan.world_size`` local Gloo processes
(one process runs in place), builds the model on meta under ``--plan`` (tensor parallel: each rank
reads and holds only its slices), and decodes greedily (``--temperature 0``, the default) or by
sampling with a KV cache (:mod:`shardwise.generate.decode`). Rank 0 prints the prompt and its
continuation.

Bad input (a missing directory, a plan with a pipeline, an empty prompt, a checkpoint without a
model config, and for the built-in GPT a plan its shape does not divide, a prompt outside its
vocabulary or longer than its context) fails as one line before any process starts.
"""

from __future__ import annotations

import argparse
import os

from shardwise.errors import ConfigError
from shardwise.layout import Plan

EXAMPLES = (
    """examples:
  shardwise generate --checkpoint runs/gpt-stdlib-x/checkpoints """
    """--prompt "def "          the built-in GPT job's checkpoint
  shardwise generate --checkpoint runs/hf-x/checkpoints --prompt "def main():"            greedy, one process
  shardwise generate --checkpoint my-hf-model/ --prompt "import os" --plan tp=2"""
    """            the model split over 2 processes
  shardwise generate --checkpoint my-hf-model/ --prompt "x =" --temperature 0.8 --top-k 40 --seed 1
  shardwise generate --checkpoint runs/ckpt --model my-hf-model/ --prompt-ids 1,5,9 --ids
"""
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text from a checkpoint or a Hugging Face directory (KV cache, tensor parallel)",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a checkpoint of 'shardwise train' (the built-in GPT or a Hugging Face model; root or step_* directory), "
        "or a Hugging Face model directory",
    )
    p.add_argument(
        "--prompt",
        default=None,
        help="the text to continue (encoded with the model's tokenizer, or the built-in GPT's characters)",
    )
    p.add_argument("--prompt-ids", default=None, metavar="IDS", help="the prompt as comma-separated token ids instead")
    p.add_argument(
        "--plan", default="tp=1", help="the layout: tp=N splits the model over N processes (default %(default)s)"
    )
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default %(default)s)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); >0: sample from softmax(logits / T)"
    )
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens only")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default %(default)s)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence at every step (no KV cache)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="Hugging Face config and tokenizer of a checkpoint (default: the copy in the checkpoint's hf/)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest complete)")
    p.add_argument("--ids", action="store_true", help="also print the token ids")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the processes are given up")
    p.set_defaults(func=_main)


def _prompt_ids(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(
            f"--prompt-ids {text!r} is not a comma-separated list of token ids", hint="e.g. --prompt-ids 1,5,9"
        ) from None
    if not ids or min(ids) < 0:
        raise ConfigError(f"--prompt-ids {text!r} must list at least one non-negative token id")
    return ids


def generate_worker(source: str, plan_text: str, prompt: str | None, prompt_ids: list[int] | None, sampling: object,
                    model_dir: str | None, step: int | None) -> dict:
    """One rank of ``shardwise generate`` (also what the tests call): ``{"ids", "new", "text"}``."""
    import torch

    from shardwise.resolve import resolve_plan
    from shardwise.parallel.mesh import build_mesh
    from shardwise.runtime import env as runtime
    from shardwise.generate.decode import check_context, generate_ids, load_model

    env = runtime.init()
    plan = resolve_plan(plan_text, env.world_size)
    meshes = build_mesh(plan, env.device.type)
    lm = load_model(
        source, plan, meshes, device=env.device, model_dir=model_dir, step=step, need_tokenizer=prompt is not None
    )
    ids = prompt_ids if prompt_ids is not None else lm.encode(prompt)
    if not ids:
        raise ConfigError("the prompt encodes to no tokens", hint="give a longer --prompt")
    check_context(len(ids), sampling, lm.context)
    out = generate_ids(lm.module, torch.tensor([ids], dtype=torch.int64), sampling, eos_token_id=lm.eos_token_id,
                       vocab_limit=lm.vocab_limit)
    tokens = out[0].tolist()
    return {"ids": tokens, "new": tokens[len(ids):], "text": lm.decode(tokens) if lm.decode is not None else None}


def _main(args: argparse.Namespace) -> int:
    from shardwise.launch.inprocess import launch
    from shardwise.generate.decode import Sampling, check_request

    if not os.path.isdir(args.checkpoint):
        raise ConfigError(
            f"--checkpoint {args.checkpoint} is not a directory",
            hint="a checkpoint directory or a Hugging Face model directory",
        )
    if (args.prompt is None) == (args.prompt_ids is None):
        raise ConfigError("give exactly one of --prompt TEXT and --prompt-ids IDS")
    if args.prompt is not None and not args.prompt:
        raise ConfigError("--prompt is empty", hint='e.g. --prompt "def main():"')
    ids = _prompt_ids(args.prompt_ids)
    plan = Plan.parse(args.plan)
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        use_cache=not args.no_cache,
    )
    check_request(args.checkpoint, plan, model_dir=args.model, prompt=args.prompt, prompt_ids=ids, sampling=sampling)
    worker_args = (args.checkpoint, str(plan), args.prompt, ids, sampling, args.model, args.step)
    if plan.world_size == 1:
        result = generate_worker(*worker_args)
    else:
        result = launch(
            generate_worker, nprocs=plan.world_size, args=worker_args, backend="gloo", timeout_s=args.timeout
        )[0]
    print(result["text"] if result["text"] is not None else " ".join(map(str, result["ids"])))
    if args.ids:
        print("ids:", ",".join(map(str, result["ids"])))
    return 0
