"""The high-level API (the MindSpore guide's ``Model.train`` with LossMonitor, TimeMonitor and
ModelCheckpoint): shardwise's Trainer with the same monitors and sharded, resumable checkpoints,
on the built-in character GPT and the standard library's source.

Run it twice: the second run resumes from the newest complete checkpoint under
``runs/gpt-high-level/checkpoints`` and stops at once because ``max_steps`` is reached.

    shardwise run --nproc-per-node 2 examples/high_level_api.py
"""

import torch
import torch.nn.functional as F

import shardwise
from shardwise.checkpoint import CheckpointManager
from shardwise.checkpoint.callback import CheckpointCallback
from shardwise.data.corpus import CharWindows, load_stdlib_corpus
from shardwise.models import GPT, GPTConfig
from shardwise.train import LossMonitor, ThroughputMonitor, warmup_cosine


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main(max_steps: int = 60) -> None:
    env = shardwise.init()
    corpus = load_stdlib_corpus(max_chars=300_000)
    config = GPTConfig(vocab_size=corpus.vocab_size, seq_len=64, layers=2, hidden=64, heads=4)
    run_dir = "runs/gpt-high-level"
    trainer = shardwise.Trainer(
        GPT(config, seed=0),
        loss_fn=lm_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1),
        global_batch_size=32,
        train=shardwise.TrainOptions(
            lr_scheduler=warmup_cosine(warmup_steps=10, total_steps=max_steps, min_lr_ratio=0.1),
            max_steps=max_steps,
            eval_every=30,
            clip_grad_norm=1.0,
            seed=0,
        ),
        logging=shardwise.LoggingOptions(
            log_every=10,
            run_dir=run_dir,
            flops_per_sample=config.flops_per_token() * config.seq_len,
            tokens_per_sample=config.seq_len,
        ),
        callbacks=[
            LossMonitor(),
            ThroughputMonitor(),
            CheckpointCallback(
                CheckpointManager(f"{run_dir}/checkpoints", every_n_steps=20, keep_last_n=2), resume="auto"
            ),
        ],
    )
    result = trainer.fit(CharWindows(corpus.train, config.seq_len), CharWindows(corpus.val, config.seq_len))
    if env.is_main:
        print(f"step {result.step}: validation loss {result.val_metrics.get('val_loss', float('nan')):.4f} nats/char "
              f"(unigram entropy {corpus.unigram_entropy:.4f})")
    shardwise.shutdown()


if __name__ == "__main__":
    main()
