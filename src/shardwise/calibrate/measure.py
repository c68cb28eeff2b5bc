"""Measure a plan on this machine, to validate the cost model against reality.

:func:`measure_plan_worker` runs on every rank of an initialized process group: it builds the
built-in GPT, applies the plan with :func:`shardwise.parallel.parallelize`, trains a few steps with
Adam on random tokens and returns this rank's model-state bytes (parameters, gradients and
optimizer state summed over the rank's local tensors, DTensor shards included) and the step times
(the slowest rank's, after warm-up). A plan the parallel layer cannot apply comes back as
``{"error": ...}`` instead of raising, so one unsupported layout does not stop a sweep.
"""

from __future__ import annotations

import statistics
import time
import warnings
from typing import Any

from shardwise.errors import ShardwiseError


def measure_plan_worker(plan_text: str, config: dict[str, Any], *, global_batch: int, steps: int = 3,
                        warmup: int = 1, lr: float = 1e-3) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.micro_step import MicroBatch
    from shardwise.parallel.parallelize import parallelize
    from shardwise.verify.state_bytes import memory_bytes
    from shardwise.layout import Plan

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # GPT returns a view; harmless here
    plan = Plan.parse(plan_text)
    cfg = GPTConfig(**config)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten(0, 1))

    try:
        meshes = build_mesh(plan, "cpu")
        pm = parallelize(GPT(cfg, seed=0), plan, meshes, **({"loss_fn": loss_fn} if plan.pp > 1 else {}))
        opt = pm.build_optimizer(torch.optim.Adam, lr=lr)
    except (ShardwiseError, NotImplementedError, RuntimeError, ValueError) as exc:
        return {"plan": plan_text, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    params = list(pm.parameters())
    dp_rank, dp_size = meshes.dp.get_local_rank(), meshes.dp.size()
    m = plan.microbatches
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, cfg.vocab_size, (global_batch, cfg.seq_len + 1), generator=gen)
    x, y = ids[:, :-1].chunk(dp_size)[dp_rank], ids[:, 1:].chunk(dp_size)[dp_rank]
    times: list[float] = []
    mem: dict[str, int] = {}
    try:
        for step in range(warmup + steps):
            dist.barrier()
            start = time.perf_counter()
            # the Trainer's micro-step: a pipeline splits the batch itself, else m micro-batches
            parts = [(x, y)] if pm.pipeline is not None else list(zip(x.chunk(m), y.chunk(m)))
            pm.forward_backward([MicroBatch(xm, ym) for xm, ym in parts], loss_fn=pm.loss_for(loss_fn), device="cpu")
            opt.step()
            elapsed = time.perf_counter() - start
            if step == warmup + steps - 1:
                mem = memory_bytes(params, opt)
            opt.zero_grad(set_to_none=True)
            if step >= warmup:
                times.append(elapsed)
    except (ShardwiseError, NotImplementedError, RuntimeError, ValueError) as exc:
        return {"plan": plan_text, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    # The step is as slow as its slowest rank; memory is reported for the busiest rank.
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    mem_t = torch.tensor([mem.get("param", 0), mem.get("grad", 0), mem.get("optim", 0)], dtype=torch.float64)
    per_rank = [torch.zeros_like(mem_t) for _ in range(dist.get_world_size())]
    dist.all_gather(per_rank, mem_t)
    busiest = max(per_rank, key=lambda r: float(r.sum()))
    del DTensor
    return {"plan": plan_text, "step_time_s": float(t.item()), "times": times,
            "memory": {"params": float(busiest[0]), "grads": float(busiest[1]), "optimizer": float(busiest[2])},
            "memory_per_rank": [[float(v) for v in r] for r in per_rank]}
