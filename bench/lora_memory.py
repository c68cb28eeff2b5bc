"""Per-rank memory and step time of full fine-tuning, LoRA and QLoRA, measured against the planner.

One HF Llama built from a config (nothing downloaded), on 2 Gloo processes, under ``dp=2`` and
``zero=3``: for each mode the per-rank bytes of parameters (torchao's real NF4 bytes for the 4-bit
base), gradients and AdamW states after a step, and the median step time of ``--steps`` steps
(interleaved rounds, the first step not timed), next to the planner's prediction of the same
(``shardwise.plan.cost.estimate`` with ``shardwise.plan.adapters.with_lora``). Step times are
compared as ratios to full fine-tuning in the same run (the CPU's absolute speed is not what the
planner is calibrated for here). Also the size of a LoRA checkpoint against a full one.

    python bench/lora_memory.py [--hidden 256] [--layers 4] [--steps 6] [--out bench/results/lora_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

MODES = ("full", "lora", "qlora")
PLANS = ("dp=2", "zero=3,shard=2")


def _bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def measure(hidden: int, layers: int, steps: int, seq: int, batch: int, ckpt_root: str) -> dict:
    """On every rank: each mode under each plan (collective); rank 0's figures."""
    from shardwise.checkpoint import CheckpointManager
    from shardwise.layout import Plan
    from shardwise.models import hf
    from shardwise.models.lora import LoRA, add_adapters
    from shardwise.models.nf4 import parameter_bytes, quantize_base
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize

    config = hf.tiny_config("llama", hidden=hidden, layers=layers, heads=4, kv_heads=4, vocab=256, seq=seq)
    out = {}
    for plan_text in PLANS:
        plan = Plan.parse(plan_text)
        meshes = build_mesh(plan, "cpu")
        for mode in MODES:
            model = hf.build_causal_lm(config, seed=0)
            if mode != "full":
                model = add_adapters(model, LoRA(r=16, alpha=32), seed=1)
            if mode == "qlora":
                quantize_base(model)
            pm = parallelize(model, plan, meshes)
            opt = pm.build_optimizer(lambda p: torch.optim.AdamW(p, lr=1e-4))
            ids = torch.randint(0, 256, (batch // 2, seq + 1), generator=torch.Generator().manual_seed(0))
            times = []
            for step in range(steps + 1):
                start = time.perf_counter()
                loss = hf.lm_loss(pm.module(ids[:, :-1]), ids[:, 1:])
                loss.backward()
                opt.step()
                if step == 0:
                    grads = _bytes(p.grad for p in pm.parameters() if p.grad is not None)
                opt.zero_grad(set_to_none=True)
                if step:
                    times.append(time.perf_counter() - start)
            held = parameter_bytes(pm.module)
            state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
            ckpt = os.path.join(ckpt_root, f"{plan_text}-{mode}")
            CheckpointManager(ckpt, keep_last_n=None).save({"model": pm.module, "optimizer": opt}, step=1)
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ckpt) for f in fs)
            out[f"{plan_text}|{mode}"] = {
                "params": held["nf4"] + held["frozen"] + held["trainable"],
                "nf4": held["nf4"],
                "grads": grads,
                "optimizer": _bytes(state),
                "step_s": statistics.median(times),
                "checkpoint_bytes": size,
            }
    return out


def predict(hidden: int, layers: int, seq: int, batch: int) -> dict:
    from shardwise.layout import Plan
    from shardwise.models import hf
    from shardwise.plan.adapters import with_lora
    from shardwise.plan.cost import estimate
    from shardwise.plan.planner import cluster_of

    config = hf.tiny_config("llama", hidden=hidden, layers=layers, heads=4, kv_heads=4, vocab=256, seq=seq).to_dict()
    stats = hf.stats_of_config(config, seq=seq)
    cluster = cluster_of("cpu", world_size=2)
    out = {}
    for plan_text in PLANS:
        for mode in MODES:
            s = stats if mode == "full" else with_lora(stats, r=16, base="nf4" if mode == "qlora" else "fp32")
            est = estimate(s, cluster, Plan.parse(plan_text), global_batch=batch)
            out[f"{plan_text}|{mode}"] = {k: est.memory[k] for k in ("params", "grads", "optimizer")} | {
                "step_s": est.step_time_s
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="bench/results/lora_memory.json")
    args = ap.parse_args()
    from shardwise.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        measured = run_distributed(
            measure, 2, args.hidden, args.layers, args.steps, args.seq, args.batch, tmp, timeout_s=1800
        )[0]
    predicted = predict(args.hidden, args.layers, args.seq, args.batch)
    rows = []
    for key, m in measured.items():
        plan, mode = key.split("|")
        p = predicted[key]
        full_m, full_p = measured[f"{plan}|full"], predicted[f"{plan}|full"]
        states_m = m["params"] + m["grads"] + m["optimizer"]
        states_p = p["params"] + p["grads"] + p["optimizer"]
        rows.append(
            {
                "plan": plan,
                "mode": mode,
                "measured": m,
                "predicted": p,
                "states_measured": states_m,
                "states_predicted": states_p,
                "states_error": states_p / states_m - 1,
                "step_ratio_measured": m["step_s"] / full_m["step_s"],
                "step_ratio_predicted": p["step_s"] / full_p["step_s"],
                "checkpoint_vs_full": m["checkpoint_bytes"] / full_m["checkpoint_bytes"],
            }
        )
        print(
            f"{plan:16s} {mode:6s} states/rank measured {states_m / 1e6:7.2f} MB predicted {states_p / 1e6:7.2f} MB "
            f"({100 * (states_p / states_m - 1):+5.1f}%)  step vs full: measured {rows[-1]['step_ratio_measured']:.2f} "
            f"predicted {rows[-1]['step_ratio_predicted']:.2f}  checkpoint {m['checkpoint_bytes'] / 1e6:.2f} MB "
            f"({100 * rows[-1]['checkpoint_vs_full']:.1f}% of full)",
            flush=True,
        )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(
            {"command": "python " + " ".join(sys.argv), "hidden": args.hidden, "layers": args.layers, "rows": rows},
            fh,
            indent=2,
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['plan']}\n{r['mode']}" for r in rows]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [r["states_measured"] / 1e6 for r in rows], 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [r["states_predicted"] / 1e6 for r in rows], 0.4, label="predicted")
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("params + grads + AdamW states per rank (MB)")
        ax.set_title(f"Llama h={args.hidden} L={args.layers}: full fine-tuning, LoRA r=16, QLoRA (NF4) on 2 ranks")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out.replace(".json", ".png"), dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
