"""Fine-tune a small Llama-style model made locally, from the command line, then take it back to transformers.

Nothing is downloaded: the model (4 layers, hidden 64) and its byte-level BPE tokenizer are created
here from the Python standard library's own source text and saved with ``save_pretrained``; the
training data are other stdlib files, copied as ``.txt``. Then, as a user would type them::

    shardwise train --model.hf runs/hf-example/model --data.files 'runs/hf-example/data/**/*.txt' \\
        --nproc 2 --plan auto --max-steps 40 --checkpoint.every_n_steps 20
    shardwise train ... --resume auto --max-steps 60        # continue from the newest checkpoint
    shardwise checkpoint export --format hf runs/hf-example/runs/finetune/checkpoints runs/hf-example/export

and the export is loaded with ``transformers.AutoModelForCausalLM.from_pretrained``.

Run:  python examples/hf_finetune_llama.py [--nproc 2] [--plan auto] [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig


def stdlib_texts(package: str) -> list[tuple[str, str]]:
    root = os.path.join(sysconfig.get_paths()["stdlib"], package)
    out = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8") as fh:
                out.append((name, fh.read()))
    return out


def shardwise(*args: str) -> None:
    print("$ shardwise " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "shardwise.cli", *args], check=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="runs/hf-example")
    parser.add_argument("--nproc", default="2")
    parser.add_argument("--plan", default="auto")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()

    from shardwise.models import hf

    model_dir, data_dir = os.path.join(args.dir, "model"), os.path.join(args.dir, "data", "stdlib")
    os.makedirs(data_dir, exist_ok=True)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        texts = [text for _, text in stdlib_texts("json") + stdlib_texts("email")]
        hf.save_tiny(
            model_dir, family="llama", texts=texts, vocab=1024, layers=4, hidden=64, heads=4, kv_heads=2, seq=128
        )
        print(f"made a Llama-style model and its tokenizer in {model_dir}", flush=True)
    for name, text in stdlib_texts("logging") + stdlib_texts("importlib"):
        with open(os.path.join(data_dir, name.replace(".py", ".txt")), "w", encoding="utf-8") as fh:
            fh.write(text)

    common = [
        "--model.hf",
        model_dir,
        "--data.files",
        os.path.join(args.dir, "data", "**", "*.txt"),
        "--model.seq_len=64",
        "--nproc",
        args.nproc,
        "--plan",
        args.plan,
        "--train.global_batch_size=8",
        "--train.lr=3e-3",
        "--train.eval_every=20",
        "--checkpoint.every_n_steps=20",
        "--run.runs_dir",
        os.path.join(args.dir, "runs"),
        "--run.name",
        "finetune",
    ]
    shardwise("train", *common, "--max-steps", str(args.steps))
    shardwise("train", *common, "--max-steps", str(args.steps + 20), "--resume", "auto")
    export = os.path.join(args.dir, "export")
    shardwise(
        "checkpoint", "export", "--format", "hf", os.path.join(args.dir, "runs", "finetune", "checkpoints"), export
    )

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    prompt = tokenizer("import logging\n", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    print("transformers loads the export; greedy continuation of 'import logging':")
    print(tokenizer.decode(out[0]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
