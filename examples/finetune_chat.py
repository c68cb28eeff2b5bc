"""Fine-tune a tiny Llama on chat data from the command line, the loss on the assistant turns only.

Nothing is downloaded. The example writes its own data and model:

- ``chat.jsonl``: 600 short chats (a user asks for a sum, the assistant answers; every third chat
  has a system prompt and a second exchange, so the chats and their assistant turns differ in
  length) and ``val.jsonl`` (60 more);
- a Llama built from a config (4 layers, hidden 64), with a byte-level BPE tokenizer trained on
  the chats and a chat template (``shardwise.models.hf.save_tiny(..., chat=True)``).

Then, as a user would type them::

    shardwise train --model.hf runs/chat-example/model --data.files runs/chat-example/chat.jsonl \\
        --data.format chat --data.packing true --nproc 2 --plan dp=2 --max-steps 60 --checkpoint.every_n_steps 30
    shardwise train ... --resume auto --max-steps 90            # continue from the newest checkpoint

(``--steps N``: a checkpoint and an evaluation every N/2 steps and N/2 more steps on resume, the
warm-up N/6: 30, 30 and 10 at the default 60.)
    shardwise checkpoint export --format hf runs/chat-example/runs/chat/checkpoints runs/chat-example/export

The loss is the mean over the assistant tokens of each global batch (``train.loss_reduction =
"tokens"``, the default), under any plan; the export is loaded with transformers and answers a
question through its chat template.

Run:  python examples/finetune_chat.py [--nproc 2] [--plan dp=2] [--steps 60] [--packing true]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys


def make_chats(n: int, seed: int) -> list[dict]:
    rng, chats = random.Random(seed), []
    for i in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        messages = [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ]
        if i % 3 == 0:
            messages = [
                {"role": "system", "content": "You add numbers."},
                *messages,
                {"role": "user", "content": "And twice that?"},
                {"role": "assistant", "content": f"Twice that is {2 * (a + b)}."},
            ]
        chats.append({"messages": messages})
    return chats


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")


def shardwise(*args: str) -> None:
    print("$ shardwise " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "shardwise.cli", *args], check=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="runs/chat-example")
    parser.add_argument("--nproc", default="2")
    parser.add_argument("--plan", default="dp=2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--packing", default="true", choices=["true", "false"])
    args = parser.parse_args()

    from shardwise.models import hf

    os.makedirs(args.dir, exist_ok=True)
    chats, val = make_chats(600, seed=0), make_chats(60, seed=1)
    data, val_data, model_dir = (os.path.join(args.dir, n) for n in ("chat.jsonl", "val.jsonl", "model"))
    write_jsonl(data, chats)
    write_jsonl(val_data, val)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        hf.save_tiny(
            model_dir,
            family="llama",
            texts=[json.dumps(c) for c in chats],
            vocab=512,
            layers=4,
            hidden=64,
            heads=4,
            kv_heads=2,
            seq=256,
            chat=True,
        )
        print(f"made a Llama from a config, with a chat-template tokenizer, in {model_dir}", flush=True)

    every = max(1, args.steps // 2)  # checkpoints and evaluations; the resume trains this much more
    common = [
        "--model.hf",
        model_dir,
        "--data.files",
        data,
        "--data.format",
        "chat",
        "--data.packing",
        args.packing,
        "--data.streaming",
        "true",
        "--data.val_files",
        val_data,
        "--model.seq_len=128",
        "--nproc",
        args.nproc,
        "--plan",
        args.plan,
        "--train.global_batch_size=16",
        "--train.lr=3e-3",
        f"--train.warmup_steps={max(1, args.steps // 6)}",
        f"--train.eval_every={every}",
        f"--checkpoint.every_n_steps={every}",
        "--run.runs_dir",
        os.path.join(args.dir, "runs"),
        "--run.name",
        "chat",
    ]
    shardwise("train", *common, "--max-steps", str(args.steps))
    shardwise("train", *common, "--max-steps", str(args.steps + every), "--resume", "auto")
    export = os.path.join(args.dir, "export")
    shardwise("checkpoint", "export", "--format", "hf", os.path.join(args.dir, "runs", "chat", "checkpoints"), export)

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    question = [{"role": "user", "content": "What is 12 plus 30?"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    print("transformers loads the export; its greedy answer to 'What is 12 plus 30?':")
    print(repr(tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
