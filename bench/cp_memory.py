"""Context parallel: activation memory per rank against cp, measured and predicted.

The built-in GPT (fp32) takes one step of a batch of two long sequences in one process (cp=1),
and split over 2 and 4 Gloo processes by context parallelism (``cp=2``, ``cp=4``: each rank holds
a half or a quarter of every sequence). Measured: the bytes autograd keeps
for backward on the busiest rank (``saved_tensors_hooks``; each storage counted once, as memory is
held). Predicted: the planner's activation memory of the same plan on the ``cpu`` preset
(:func:`shardwise.plan.cost.estimate`, which slices each sample ``1/cp``). Writes
bench/results/cp_memory.json and bench/results/cp_memory.png.

Run:  .venv/bin/python bench/cp_memory.py [--seq 2048] [--hidden 128] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))
PLANS = ((1, "dp=1"), (2, "cp=2"), (4, "cp=4"))  # (processes, plan)


def saved_bytes(plan_text: str, shape: dict[str, Any], batch: int) -> float:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardwise.layout import Plan
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize

    plan = Plan.parse(plan_text, world_size=dist.get_world_size())
    cfg = GPTConfig(**shape)
    meshes = build_mesh(plan, "cpu")
    pm = parallelize(GPT(cfg, seed=0), plan, meshes)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    rank, size = meshes.dp.get_local_rank(), meshes.dp.size()
    x, y, extra = pm.shard_batch(ids[:, :-1].chunk(size)[rank], ids[:, 1:].chunk(size)[rank])
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        held[storage.data_ptr()] = max(held.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), pm.step_context():
        loss = F.cross_entropy(pm.module(x, **extra).flatten(0, 1), y.flatten())
        loss.backward()
    t = torch.tensor([float(sum(held.values()))], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def predicted(plan_text: str, shape: dict[str, Any], batch: int) -> float:
    from shardwise.layout import Plan
    from shardwise.models.gpt import GPTConfig
    from shardwise.plan.cluster import resolve
    from shardwise.plan.cost import estimate
    from shardwise.plan.stats import transformer_stats

    plan = Plan.parse(plan_text)
    n = plan.world_size
    return estimate(transformer_stats(GPTConfig(**shape)), resolve("cpu", devices=n, devices_per_node=n), plan,
                    global_batch=batch).memory["activations"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(RESULTS, "cp_memory.json"))
    args = parser.parse_args()

    from shardwise.testing import WorkerPool

    shape = {
        "vocab_size": 256,
        "seq_len": args.seq,
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": max(1, args.hidden // 32),
    }
    batch = 2
    rows = []
    for n, plan in PLANS:
        pool = WorkerPool(n, timeout_s=900)
        try:
            rows.append({"plan": plan, "cp": n, "measured_bytes": pool.run(saved_bytes, plan, shape, batch)[0],
                         "predicted_bytes": predicted(plan, shape, batch)})
        finally:
            pool.close()
    base = rows[0]["measured_bytes"]
    for row in rows:
        row["measured_vs_cp1"] = row["measured_bytes"] / base
        row["predicted_over_measured"] = row["predicted_bytes"] / row["measured_bytes"]
    result = {"shape": shape, "global_batch": batch, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    for row in rows:
        print(
            f"{row['plan']:<10} cp={row['cp']}: measured {row['measured_bytes'] / 2**20:8.1f} MiB "
            f"({row['measured_vs_cp1']:.2f} x cp=1), predicted {row['predicted_bytes'] / 2**20:8.1f} MiB "
            f"({row['predicted_over_measured']:.2f} x measured)"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    cps = [r["cp"] for r in rows]
    ax.plot(cps, [r["measured_bytes"] / 2**20 for r in rows], "o-", label="measured (busiest rank)")
    ax.plot(cps, [r["predicted_bytes"] / 2**20 for r in rows], "s--", label="planner")
    ax.plot(cps, [base / 2**20 / c for c in cps], ":", color="gray", label="1/cp of cp=1")
    ax.set_xscale("log", base=2)
    ax.set_xticks(cps, [str(c) for c in cps])
    ax.set_xlabel("cp")
    ax.set_ylabel("activations kept for backward (MiB)")
    ax.set_title(f"GPT fp32, 2 sequences of {args.seq}, hidden {args.hidden}")
    ax.legend()
    fig.tight_layout()
    png = os.path.splitext(args.out)[0] + ".png"
    fig.savefig(png, dpi=120)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
