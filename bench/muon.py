"""Muon against AdamW on the built-in job (``shardwise train``: the character GPT on the standard
library's source), in one invocation, on the same data and seed:

1. **validation loss** after ``--steps`` steps under ``dp=2``, each optimizer at the best of a small
   learning-rate grid (AdamW: ``train.lr``; Muon: ``train.muon_lr`` on the hidden matrices, AdamW
   at 3e-3 on embeddings, head, norms and biases);
2. **step time**: the median ``step_time_s`` of 20-step runs after their first 5 steps, Muon (the
   job's default bf16 Newton-Schulz) against AdamW, under ``dp=2`` and ``zero=3``;
3. **communication**: the bytes Muon's all-to-alls send per rank and step under ``zero=3`` on 2
   processes (counted at ``torch.distributed.all_to_all_single``), against the planner's
   prediction (:func:`shardwise.plan.muon.muon_cost`).

Writes bench/results/muon.json and .png.

Run:  .venv/bin/python bench/muon.py [--steps 150] [--nproc 2]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ROOT = os.path.dirname(HERE)
LAYERS, HIDDEN, HEADS, SEQ = 2, 64, 4, 64
MODEL = [f"--model.layers={LAYERS}", f"--model.hidden={HIDDEN}", f"--model.heads={HEADS}", f"--model.seq_len={SEQ}",
         "--data.max_chars=300000", "--train.global_batch_size=16", "--train.warmup_steps=10", "--train.log_every=1",
         "--train.eval_every=0", "--sample.chars=0"]
GRID = {
    "adamw lr=3e-3": ["--train.lr=3e-3"],
    "adamw lr=1e-2": ["--train.lr=1e-2"],
    "muon lr=0.02": ["--train.optimizer=muon", "--train.muon_lr=0.02"],
    "muon lr=0.05": ["--train.optimizer=muon", "--train.muon_lr=0.05"],
}


def train(name: str, extra: list[str], *, steps: int, nproc: int, cwd: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src")}
    run = name.replace(" ", "-").replace("=", "")
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--nproc", str(nproc), f"--run.name={run}",
                           f"--max-steps={steps}", *MODEL, *extra], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    with open(os.path.join(cwd, "runs", run, "metrics.csv")) as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("loss")]
    with open(os.path.join(cwd, "runs", run, "summary.json")) as fh:
        summary = json.load(fh)
    times = [float(r["step_time_s"]) for r in rows[5:]]
    return {
        "steps": [int(r["step"]) for r in rows],
        "loss": [float(r["loss"]) for r in rows],
        "val_loss": summary["val_loss"],
        "step_time_s": statistics.median(times) if times else None,
    }


def count_all_to_all(steps: int) -> list[float]:
    """Worker: bytes this rank sends to other ranks through all_to_all_single per Muon step (ZeRO-3)."""
    import torch
    import torch.distributed as dist

    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.optim import muon
    from shardwise.train import LoggingOptions, TrainOptions, Trainer

    sent = []
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        me = dist.get_rank(group)
        sent.append(sum(n for r, n in enumerate(input_split_sizes) if r != me) * input.element_size())
        return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    dist.all_to_all_single = counting
    try:
        config = GPTConfig(vocab_size=96, seq_len=SEQ, layers=LAYERS, hidden=HIDDEN, heads=HEADS)
        ids = torch.randint(0, 96, (64, SEQ + 1), generator=torch.Generator().manual_seed(0))
        trainer = Trainer(GPT(config, seed=0),
                          loss_fn=lambda o, t: torch.nn.functional.cross_entropy(o.flatten(0, 1), t.flatten()),
                          optimizer=muon(lr=0.02), plan="zero=3", global_batch_size=8,
                          train=TrainOptions(max_steps=steps), logging=LoggingOptions(progress_bar=False))
        trainer.fit(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]))
    finally:
        dist.all_to_all_single = original
    return [sum(sent) / steps]


def predicted_bytes(nproc: int) -> float:
    from shardwise.layout import Plan
    from shardwise.plan.muon import muon_cost
    from shardwise.plan.planner import cluster_of
    from shardwise.plan.stats import transformer_stats
    from shardwise.shape import TransformerShape

    stats = transformer_stats(TransformerShape(layers=LAYERS, hidden=HIDDEN, heads=HEADS, vocab_size=96, seq_len=SEQ))
    return muon_cost(stats, Plan.parse(f"zero=3,shard={nproc}"), cluster_of("cpu", world_size=nproc)).comm_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    out: dict = {"command": f"bench/muon.py --steps {args.steps} --nproc {args.nproc}", "model": MODEL}
    with tempfile.TemporaryDirectory() as tmp:
        grid = {name: train(name, ["--plan", f"dp={args.nproc}", *extra], steps=args.steps, nproc=args.nproc, cwd=tmp)
                for name, extra in GRID.items()}
        timing = {
            f"{opt} {plan}": train(
                f"t {opt} {plan}", ["--plan", plan, *GRID[best]], steps=20, nproc=args.nproc, cwd=tmp
            )
            for plan in (f"dp={args.nproc}", "zero=3")
            for opt, best in (("adamw", "adamw lr=3e-3"), ("muon", "muon lr=0.02"))
        }
    best = {k: min((n for n in grid if n.startswith(k)), key=lambda n: grid[n]["val_loss"]) for k in ("adamw", "muon")}
    out["loss"] = {
        name: {"val_loss": run["val_loss"], "final_train_loss": run["loss"][-1]} for name, run in grid.items()
    }
    out["best"] = {k: {"run": n, "val_loss": grid[n]["val_loss"]} for k, n in best.items()}
    out["step_time_s"] = {name: run["step_time_s"] for name, run in timing.items()}
    out["muon_overhead"] = {plan: timing[f"muon {plan}"]["step_time_s"] / timing[f"adamw {plan}"]["step_time_s"]
                            for plan in (f"dp={args.nproc}", "zero=3")}
    sys.path[:0] = [HERE, os.path.join(ROOT, "src")]  # this checkout's shardwise, in the workers too
    from shardwise.testing import WorkerPool

    pool = WorkerPool(args.nproc)
    try:
        measured = pool.run(__import__("muon").count_all_to_all, 3)
    finally:
        pool.close()
    out["all_to_all_bytes_per_rank_step"] = {
        "measured": [m[0] for m in measured],
        "predicted": predicted_bytes(args.nproc),
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "muon.json"), "w") as fh:
        json.dump(out, fh, indent=2)
    _plot(grid, out)
    print(
        json.dumps(
            {k: out[k] for k in ("best", "step_time_s", "muon_overhead", "all_to_all_bytes_per_rank_step")}, indent=2
        )
    )
    return 0


def _plot(grid: dict, out: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, run in grid.items():
        ax.plot(run["steps"], run["loss"], label=f"{name} (val {run['val_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/char)")
    ax.set_title("built-in GPT, dp=2: Muon (hidden matrices) + AdamW against AdamW")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "muon.png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
