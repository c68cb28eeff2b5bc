"""The SimpleNet digits run with shardwise's Trainer: the same job as ddp_plain.py, no loop to write.

Differences that matter: ``global_batch_size`` is the batch of one optimizer step over all ranks
(so 1, 2 or 4 processes train the same model with the same seed), and the validation loss and
accuracy are global sums over counts, each sample counted once.

    shardwise run --nproc-per-node 2 examples/simplenet_digits.py
"""

import torch
import torch.nn.functional as F

import shardwise
from shardwise.data.digits import load_digits
from shardwise.models import SimpleNet


def main() -> None:
    data = load_digits(flatten=True)
    trainer = shardwise.Trainer(
        SimpleNet(input_dim=64, hidden_dim=256, num_classes=10, dropout=0.5, seed=0),
        loss_fn=F.cross_entropy,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
        global_batch_size=64,
        train=shardwise.TrainOptions(max_epochs=10, seed=0),
        logging=shardwise.LoggingOptions(metrics=["accuracy"], run_dir="runs/simplenet-digits"),
    )
    result = trainer.fit(data.train, data.val)
    if trainer.env.is_main:
        print(
            f"validation loss {result.val_metrics['val_loss']:.4f}, accuracy {result.val_metrics['val_accuracy']:.3f}"
        )
    shardwise.shutdown()


if __name__ == "__main__":
    main()
