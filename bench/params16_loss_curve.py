"""The loss curve of 16-bit parameter storage (``params16``) against fp32 over 200 steps of the
built-in job (``shardwise train``: the character GPT on the standard library's source), in one
invocation, on the same data and seed, on 2 processes:

- ``fp32``: ``--plan dp=2``, fp32 parameters and compute;
- ``bf16 autocast``: ``--plan dp=2 --train.precision=bf16``: fp32 parameters under autocast (DDP);
- ``params16``: ``--plan dp=2,params16 --train.precision=bf16``: FSDP2's replicate casts the fp32
  masters to bf16, no autocast (every operator and saved activation in bf16, the loss under
  autocast);
- ``zero=3 params16``: ``--plan zero=3,params16 --train.precision=bf16``: the same with sharded
  masters (``zero=3`` with ``precision=bf16`` alone all-gathers bf16 parameters too, and CPU
  autocast keeps LayerNorm in bf16, so on a CPU it computes what params16 does).

Reports the training loss of each logged step, the relative difference of each bf16 curve to
fp32 (max over the steps after warm-up and over the last 50 steps) and the final validation loss.
Writes bench/results/params16_loss_curve.json and .png.

Run:  .venv/bin/python bench/params16_loss_curve.py [--steps 200] [--nproc 2]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
ROOT = os.path.dirname(HERE)

MODEL = ["--model.layers=2", "--model.hidden=64", "--model.heads=4", "--model.seq_len=64", "--data.max_chars=300000",
         "--train.global_batch_size=16", "--train.warmup_steps=20", "--train.log_every=5", "--train.eval_every=50",
         "--sample.chars=0"]
RUNS = {
    "fp32": ["--plan", "dp=2"],
    "bf16 autocast": ["--plan", "dp=2", "--train.precision=bf16"],
    "params16": ["--plan", "dp=2,params16", "--train.precision=bf16"],
    "zero=3 params16": ["--plan", "zero=3,params16", "--train.precision=bf16"],
}


def train(name: str, extra: list[str], *, steps: int, nproc: int, cwd: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src")}
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardwise.cli",
            "train",
            "--nproc",
            str(nproc),
            f"--run.name={name.replace(' ', '-').replace('=', '')}",
            f"--max-steps={steps}",
            *MODEL,
            *extra,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    run_dir = os.path.join(cwd, "runs", name.replace(" ", "-").replace("=", ""))
    with open(os.path.join(run_dir, "metrics.csv")) as fh:
        rows = list(csv.DictReader(fh))
    with open(os.path.join(run_dir, "summary.json")) as fh:
        summary = json.load(fh)
    return {
        "steps": [int(r["step"]) for r in rows if r.get("loss")],
        "loss": [float(r["loss"]) for r in rows if r.get("loss")],
        "val_loss": summary.get("val_loss"),
        "plan": summary.get("plan"),
        "seconds": time.perf_counter() - start,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        curves = {name: train(name, extra, steps=args.steps, nproc=args.nproc, cwd=tmp) for name, extra in RUNS.items()}
    ref = curves["fp32"]
    out: dict = {
        "command": f"bench/params16_loss_curve.py --steps {args.steps} --nproc {args.nproc}",
        "model": MODEL,
        "runs": curves,
        "vs_fp32": {},
    }
    for name in [n for n in curves if n != "fp32"]:
        rel = [abs(a - b) / b for a, b, s in zip(curves[name]["loss"], ref["loss"], ref["steps"]) if s > 20]
        last = [
            abs(a - b) / b for a, b, s in zip(curves[name]["loss"], ref["loss"], ref["steps"]) if s > args.steps - 50
        ]
        out["vs_fp32"][name] = {"max_rel_loss_diff": max(rel), "max_rel_loss_diff_last_50": max(last),
                                "val_loss": curves[name]["val_loss"], "fp32_val_loss": ref["val_loss"],
                                "val_rel_diff": abs(curves[name]["val_loss"] - ref["val_loss"]) / ref["val_loss"]}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "params16_loss_curve.json"), "w") as fh:
        json.dump(out, fh, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
        for name, curve in curves.items():
            top.plot(curve["steps"], curve["loss"], label=f"{name} (val {curve['val_loss']:.4f})")
        for name in [n for n in curves if n != "fp32"]:
            bottom.plot(
                ref["steps"], [100 * (a - b) / b for a, b in zip(curves[name]["loss"], ref["loss"])], label=name
            )
        top.set_ylabel("training loss")
        top.set_title(f"built-in job on {args.nproc} processes: 16-bit parameter storage against fp32")
        top.legend()
        bottom.axhline(0, color="grey", lw=0.5)
        bottom.set_ylabel("vs fp32 (%)")
        bottom.set_xlabel("step")
        bottom.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, "params16_loss_curve.png"), dpi=110)
    except ImportError:
        print("matplotlib is not installed: no PNG")
    for name, row in out["vs_fp32"].items():
        print(
            f"{name:16s} max |loss - fp32| / fp32 after warm-up {row['max_rel_loss_diff']:.4f}, last 50 steps "
            f"{row['max_rel_loss_diff_last_50']:.4f}; val loss {row['val_loss']:.4f} vs fp32 {row['fp32_val_loss']:.4f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
