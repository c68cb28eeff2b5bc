"""Expert parallel against replicated experts: step time, and the all-to-all share of an ep step.

The built-in MoE GPT (``--experts`` experts per layer, top-2) trains on 2 Gloo processes for a few
Adam steps in two layouts of the same global batch:

- ``dp=2``: every rank holds all experts (the experts' gradients are all-reduced with the rest);
- ``dp=2,ep=2``: each rank holds half of them; tokens travel to their experts and back by
  all-to-all (two per MoE layer forward, two backward).

Per layout the median step time over ``--steps`` timed steps (after a warm-up) is the slowest
rank's; for ep the time inside the all-to-alls comes from ``torch.profiler`` (the c10d
``alltoall`` events of one profiled step), reported as a share of that step. Repeats alternate
the two layouts (the machine is shared; the ratio of medians is what to read). Writes
bench/results/ep_step.json and bench/results/ep_step.png.

Run:  .venv/bin/python bench/ep_step.py [--experts 8] [--hidden 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def step_worker(plan_text: str, shape: dict[str, Any], batch: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardwise.layout import Plan
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.parallel.ep import expert_modules
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize

    plan = Plan.parse(plan_text)
    cfg = GPTConfig(**shape)
    meshes = build_mesh(plan, "cpu")
    pm = parallelize(GPT(cfg, seed=0), plan, meshes)
    opt = pm.build_optimizer(torch.optim.Adam, lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=gen)
    rank, size = meshes.dp.get_local_rank(), meshes.dp.size()
    x, y = ids[:, :-1].chunk(size)[rank], ids[:, 1:].chunk(size)[rank]

    def step() -> None:
        with pm.step_context():
            F.cross_entropy(pm.module(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    comm = 0.0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dist.barrier()
        start = time.perf_counter()
        step()
        profiled = time.perf_counter() - start
    for event in prof.key_averages():
        if "alltoall" in event.key.lower() or "all_to_all" in event.key.lower():
            comm = max(comm, event.cpu_time_total / 1e6)  # nested events count the same wait; take the outermost
    expert_elems = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                       for _, m in expert_modules(pm.module) for p in m.parameters())
    return {"plan": plan_text, "step_s": float(t.item()), "all_to_all_s": comm, "profiled_step_s": profiled,
            "expert_params_per_rank": expert_elems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(RESULTS, "ep_step.json"))
    args = parser.parse_args()

    from shardwise.testing import WorkerPool

    shape = {"vocab_size": 256, "seq_len": args.seq, "layers": args.layers, "hidden": args.hidden,
             "heads": max(1, args.hidden // 32), "experts": args.experts, "top_k": 2}
    pool = WorkerPool(2, timeout_s=900)
    rows: dict[str, list[dict[str, Any]]] = {"dp=2": [], "dp=2,ep=2": []}
    try:
        for _ in range(args.repeats):
            for plan in rows:  # interleaved: both layouts see the same machine load
                rows[plan].append(pool.run(step_worker, plan, shape, args.batch, args.steps)[0])
    finally:
        pool.close()
    dense, ep = (statistics.median(r["step_s"] for r in rows[p]) for p in rows)
    share = statistics.median(r["all_to_all_s"] / r["profiled_step_s"] for r in rows["dp=2,ep=2"])
    result = {"shape": shape, "batch": args.batch, "repeats": rows,
              "median_step_s": {"replicated (dp=2)": dense, "ep=2": ep}, "ep_over_replicated": ep / dense,
              "all_to_all_share_of_ep_step": share,
              "expert_params_per_rank": {p: rows[p][0]["expert_params_per_rank"] for p in rows}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"step: replicated experts {dense * 1e3:.1f} ms, ep=2 {ep * 1e3:.1f} ms (ratio {ep / dense:.3f}); "
          f"all-to-all {100 * share:.1f}% of the ep step; expert parameters per rank "
          f"{result['expert_params_per_rank']['dp=2']:,} -> {result['expert_params_per_rank']['dp=2,ep=2']:,}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    compute = [dense, ep * (1 - share)]
    ax.bar(["replicated (dp=2)", "ep=2"], compute, label="compute + other", color="#4c72b0")
    ax.bar(["ep=2"], [ep * share], bottom=[ep * (1 - share)], label="all-to-all", color="#dd8452")
    ax.set_ylabel("step time (s), median")
    ax.set_title(f"MoE GPT, {args.experts} experts, 2 Gloo processes")
    ax.legend()
    fig.tight_layout()
    png = os.path.splitext(args.out)[0] + ".png"
    fig.savefig(png, dpi=120)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
