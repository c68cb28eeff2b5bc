"""The reference guides' ResNet-50 run, scaled down: a small ResNet on 8x8 digits with
SyncBatchNorm, the learning rate scaled linearly with the number of replicas, and a cosine schedule.

As in the guide (``learning_rate = 0.1 * rank_size``, ``cosine_decay_lr``, SGD with momentum 0.9
and weight decay 1e-4), with a short warmup that the linear rule needs at large scale (Goyal et
al. 2017). SyncBatchNorm computes the batch statistics over the global batch (one all-reduce per
BatchNorm layer per forward), so small per-rank batches normalize like one large batch.

    shardwise run --nproc-per-node 2 examples/resnet_digits.py
"""

import torch
import torch.nn.functional as F

import shardwise
from shardwise.data.digits import load_digits
from shardwise.models import resnet_small
from shardwise.parallel.ddp import DDPOptions
from shardwise.train import LossMonitor, ThroughputMonitor, scale_lr, warmup_cosine


def main(epochs: int = 4, per_rank_batch: int = 32, base_lr: float = 0.05) -> None:
    env = shardwise.init()
    data = load_digits()
    lr = scale_lr(base_lr, env.world_size, rule="linear")  # base_lr is for one process
    global_batch = per_rank_batch * env.world_size
    total_steps = epochs * (len(data.train) // global_batch)
    trainer = shardwise.Trainer(
        resnet_small(in_channels=1, num_classes=10, seed=0),
        loss_fn=F.cross_entropy,
        optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4),
        global_batch_size=global_batch,
        train=shardwise.TrainOptions(
            lr_scheduler=warmup_cosine(warmup_steps=total_steps // 10, total_steps=total_steps),
            max_epochs=epochs,
            seed=0,
        ),
        parallel=shardwise.ParallelOptions(ddp=DDPOptions(sync_batchnorm=True)),
        logging=shardwise.LoggingOptions(metrics=["accuracy"], log_every=10, run_dir="runs/resnet-digits"),
        callbacks=[LossMonitor(), ThroughputMonitor()],
    )
    result = trainer.fit(data.train, data.val)
    if env.is_main:
        print(f"lr {lr:g} for {env.world_size} replicas; validation accuracy {result.val_metrics['val_accuracy']:.3f}")
    shardwise.shutdown()


if __name__ == "__main__":
    main()
