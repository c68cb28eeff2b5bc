"""Worker used by the launcher tests: join the world, all_reduce, print one line per rank."""

import torch
import torch.distributed as dist

import shardwise

env = shardwise.init()
t = torch.tensor([float(env.rank + 1)])
dist.all_reduce(t)
print(f"WORLD rank={env.rank} world={env.world_size} local={env.local_rank} node={env.node_rank} "
      f"launcher={env.launcher} sum={t.item():.0f}", flush=True)
shardwise.shutdown()
