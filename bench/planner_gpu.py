"""The planner's GPU preset against one real GPU: memory and step time of the built-in GPT.

The CPU validation (``bench/planner_validation.py``) checks the cost model's *structure* on 4 Gloo
processes; this script checks the *figures* of a GPU preset (``h200``, ``h100``, ... picked by the
device name) on the GPU it runs on, for one process (plan ``dp=1``) and a GPT large enough for the
GPU to be busy:

- model states: parameters + gradients + Adam state bytes after a step vs the prediction;
- activations: ``memory_allocated`` right after forward (the loss included) minus before it, vs the
  predicted activation bytes (Korthikanti et al. 2022 for the transformer layers, the logits and
  the loss's fp32 copy), for precision fp32 / bf16 and recomputation none / full;
- peak: ``max_memory_allocated`` over a step vs the predicted total;
- step time: median of timed steps (CUDA-synchronized) vs the predicted step time, with the
  device's preset and (``--spec``) with a spec calibrated on this GPU.

Writes ``bench/results/planner_gpu.json`` (or ``--out``). Needs CUDA; one process, no launcher:

    python bench/planner_gpu.py [--layers 8 --hidden 1024 --heads 16 --seq 1024 --vocab 32768 --batch 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def run_case(cfg, precision: str, recompute: str, batch: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F

    from shardwise.models.gpt import GPT
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize
    from shardwise.layout import Plan
    from shardwise.train.precision import autocast

    plan = Plan(recompute=recompute, precision=precision)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    pm = parallelize(GPT(cfg, seed=0).cuda(), plan, build_mesh(plan, "cuda"))
    opt = pm.build_optimizer(torch.optim.Adam, lr=1e-4)
    params = [p for p in pm.parameters()]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), device="cuda", generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    times, act, peak = [], 0, 0
    for step in range(steps + 2):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with autocast(precision, "cuda"):
            out = pm.module(x)
        loss = F.cross_entropy(out.float().flatten(0, 1), y.flatten(0, 1))
        torch.cuda.synchronize()
        act = torch.cuda.memory_allocated() - before
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep gradients allocated, as the cost model counts them
        torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated()
        del out, loss
    states = {
        "params": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer": sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0),
    }
    del pm, opt, params
    torch.cuda.empty_cache()
    return {"plan": str(plan), "states": states, "activations": act, "peak": peak, "times": times,
            "step_time_s": statistics.median(times)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--spec",
        default=None,
        help="also predict with this calibrated spec (shardwise calibrate --nproc 1 on this GPU)",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results", "planner_gpu.json"))
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("planner_gpu: needs a CUDA device")
        return 2
    from shardwise.models.gpt import GPTConfig
    from shardwise.plan.cost import estimate
    from shardwise.layout import Plan
    from shardwise.plan.planner import cluster_for_device
    from shardwise.plan.stats import transformer_stats

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    name = torch.cuda.get_device_name(0)
    memory = float(torch.cuda.get_device_properties(0).total_memory)
    cluster = cluster_for_device("cuda", world_size=1, device_name=name, memory_bytes=memory)
    calibrated = None
    if args.spec:
        from shardwise.plan.cluster import ClusterSpec

        calibrated = ClusterSpec.load(args.spec).with_devices(1, 1)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    stats = transformer_stats(cfg)
    rows = []
    for precision in ("bf16", "fp32"):
        for recompute in ("none", "full"):
            got = run_case(cfg, precision, recompute, args.batch, args.steps)
            pred = estimate(stats, cluster, Plan(recompute=recompute, precision=precision), global_batch=args.batch)
            pred_states = pred.memory["params"] + pred.memory["grads"] + pred.memory["optimizer"]
            row = {
                "precision": precision, "recompute": recompute, "measured": got,
                "predicted": {"memory": pred.memory, "total": pred.memory_total, "step_time_s": pred.step_time_s,
                              "time": pred.time},
                "states_error": sum(got["states"].values()) / pred_states - 1,
                "activations_error": got["activations"] / pred.memory["activations"] - 1,
                "peak_over_predicted_total": got["peak"] / pred.memory_total,
                "time_ratio_measured_over_predicted": got["step_time_s"] / pred.step_time_s,
            }
            if calibrated is not None:
                cal = estimate(
                    stats, calibrated, Plan(recompute=recompute, precision=precision), global_batch=args.batch
                )
                row["predicted_calibrated"] = {"step_time_s": cal.step_time_s, "time": cal.time}
                row["time_ratio_measured_over_calibrated"] = got["step_time_s"] / cal.step_time_s
            rows.append(row)
            print(
                f"{precision} recompute={recompute:<5} states {sum(got['states'].values()) / 1e9:6.3f} GB "
                f"(pred {pred_states / 1e9:6.3f}, {100 * row['states_error']:+.1f}%)  activations "
                f"{got['activations'] / 1e9:6.3f} GB (pred {pred.memory['activations'] / 1e9:6.3f}, "
                f"{100 * row['activations_error']:+.1f}%)  peak {got['peak'] / 1e9:6.3f} GB (pred total "
                f"{pred.memory_total / 1e9:6.3f})  step {1e3 * got['step_time_s']:7.2f} ms (pred "
                f"{1e3 * pred.step_time_s:7.2f}, x{row['time_ratio_measured_over_predicted']:.2f}"
                + (
                    f"; calibrated {1e3 * row['predicted_calibrated']['step_time_s']:7.2f}, "
                    f"x{row['time_ratio_measured_over_calibrated']:.2f}"
                    if calibrated is not None
                    else ""
                )
                + ")",
                flush=True,
            )
    out = {
        "device": name,
        "cluster": cluster.name,
        "config": cfg.__dict__,
        "batch": args.batch,
        "torch": torch.__version__,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
