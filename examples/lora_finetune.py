"""LoRA fine-tuning end to end, on a tiny Llama written from a config (nothing is downloaded):

    python examples/lora_finetune.py                 # 2 processes, plan zero=3
    python examples/lora_finetune.py --plan tp=2 --nf4   # (QLoRA refuses tp; try --plan dp=2 --nf4)

1. write a small Llama directory (config.json, safetensors, a tokenizer trained on stdlib text);
2. train LoRA adapters (r=8, the family's attention and MLP projections) on a frozen base under the
   plan, each rank reading only its slices of the base, with a checkpoint at step 10;
3. resume from that checkpoint to step 20 (adapters only are saved: compare the sizes printed);
4. export the adapters to a PEFT directory and check that ``PeftModel.from_pretrained`` gives the
   trained model's logits.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

import shardwise
from shardwise.models import hf
from shardwise.models.lora import LoRA

SEQ = 32


def windows(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.tensor(tokens[: (len(tokens) // (SEQ + 1)) * (SEQ + 1)]).view(-1, SEQ + 1)
    return [(row[:-1], row[1:]) for row in ids]


def train(model_dir: str, ckpt: str, plan: str, nf4: bool, steps: int) -> dict:
    from shardwise.checkpoint import CheckpointManager

    tokenizer = hf.load_tokenizer(model_dir)
    data = windows(tokenizer.encode(open(os.__file__).read()))
    lora = LoRA(r=8, alpha=16, base="nf4" if nf4 else "fp32")
    trainer = shardwise.Trainer(shardwise.Pretrained(model_dir, lora=lora), loss_fn=hf.lm_loss, global_batch_size=8,
                                plan=plan, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                                train=shardwise.TrainOptions(max_steps=steps, clip_grad_norm=1.0),
                                logging=shardwise.LoggingOptions(progress_bar=False),
                                checkpoint=CheckpointManager(ckpt, every_n_steps=10))
    result = trainer.fit(data, resume="auto")
    x = data[0][0][None]
    with torch.no_grad():
        logits = trainer.model.module(x).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return {"loss": result.train_loss, "logits": logits, "x": x}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="zero=3")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--nf4", action="store_true", help="QLoRA: the frozen base in torchao's NF4")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, ckpt = os.path.join(tmp, "llama"), os.path.join(tmp, "ckpt")
        hf.save_tiny(model_dir, family="llama", texts=[open(os.__file__).read()], vocab=256, seq=SEQ, hidden=64)
        first = shardwise.launch(train, args.nproc, (model_dir, ckpt, args.plan, args.nf4, 10))[0]
        second = shardwise.launch(train, args.nproc, (model_dir, ckpt, args.plan, args.nf4, 20))[
            0
        ]  # resumes at step 10
        size = lambda d: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)  # noqa: E731
        print(f"loss {first['loss']:.3f} at step 10, {second['loss']:.3f} at step 20; a checkpoint is "
              f"{size(os.path.join(ckpt, 'step_00000020')) / 1e3:.0f} kB, the base {size(model_dir) / 1e3:.0f} kB")
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        from shardwise.checkpoint.peft_export import export_peft

        export_peft(ckpt, os.path.join(tmp, "adapter"))
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), os.path.join(tmp, "adapter"))
        with torch.no_grad():
            diff = (model(second["x"]).logits - second["logits"]).abs().max().item()
        print(f"PEFT export: logits of PeftModel.from_pretrained differ from the trained model's by {diff:.2e}"
              + (" (QLoRA: exported onto the full-precision base)" if args.nf4 else ""))


if __name__ == "__main__":
    main()
