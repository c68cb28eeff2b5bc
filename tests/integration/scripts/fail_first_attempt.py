"""Rank 1 fails on the first attempt (restart count 0) and succeeds after a restart."""

import os
import sys

import torch
import torch.distributed as dist

import shardwise

env = shardwise.init()
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if env.rank == 1 and attempt == 0:
    raise RuntimeError(f"injected failure on rank {env.rank}, attempt {attempt}")
t = torch.ones(1)
dist.all_reduce(t)
print(f"OK rank={env.rank} attempt={attempt} sum={t.item():.0f}", flush=True)
shardwise.shutdown()
sys.exit(0)
