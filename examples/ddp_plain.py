"""Plain data-parallel training: the reference guides' DDP script, with shardwise only starting it.

The guide's ``train_ddp`` sets MASTER_ADDR/PORT by hand, calls ``init_process_group`` and is
started with ``mp.spawn``. Here ``shardwise run`` starts the processes and ``shardwise.init()``
forms the process group (NCCL on GPUs, Gloo on CPUs); the loop itself is unchanged plain PyTorch:
DistributedSampler + DDP + AdamW. The model is the MindSpore guide's SimpleNet
(Dense-ReLU-Dropout-Dense) on scikit-learn's 8x8 digits instead of MNIST (nothing to download).

    shardwise run --nproc-per-node 2 examples/ddp_plain.py
"""

import os

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import shardwise
from shardwise.data.digits import load_digits
from shardwise.models import SimpleNet


def main(num_epochs: int = 5, batch_size: int = 32) -> None:
    env = shardwise.init()  # replaces setup_distributed(rank, world_size)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    data = load_digits(flatten=True)
    model = DDP(SimpleNet(input_dim=64, hidden_dim=256, num_classes=10).to(env.device),
                device_ids=[env.local_rank] if env.device.type == "cuda" else None)
    sampler = DistributedSampler(data.train, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0)
    loader = DataLoader(data.train, batch_size=batch_size, sampler=sampler, pin_memory=env.device.type == "cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.001)
    criterion = nn.CrossEntropyLoss()

    for epoch in range(num_epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        model.train()
        total_loss = 0.0
        for batch_idx, (data_, target) in enumerate(loader):
            data_, target = data_.to(env.device), target.to(env.device)
            optimizer.zero_grad()
            loss = criterion(model(data_), target)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            optimizer.step()
            total_loss += loss.item()
            if batch_idx % 10 == 0 and env.is_main:
                print(f"Epoch {epoch}, Batch {batch_idx}, Loss: {loss.item():.4f}")
        if env.is_main:  # note: this is rank 0's average only; the Trainer reports the global one
            print(f"Epoch {epoch} completed, Average Loss: {total_loss / len(loader):.4f}")

    # Accuracy over the whole validation split, counted on rank 0 only (the plain way).
    if env.is_main:
        model.eval()
        with torch.no_grad():
            x, y = data.val.tensors
            accuracy = (model.module(x.to(env.device)).argmax(1).cpu() == y).float().mean().item()
        print(f"validation accuracy {accuracy:.3f}")
        os.makedirs("runs", exist_ok=True)
        torch.save(model.module.state_dict(), "runs/simplenet_digits.pth")  # the guide's torch.save of model.module
    shardwise.shutdown()  # replaces cleanup_distributed()


if __name__ == "__main__":
    main()
