"""FP8 against bf16 on the built-in job: the loss curves of ``shardwise train`` over 300 steps.

Two runs of the built-in GPT job (the standard library's source, character-level, AdamW with
warmup + cosine), identical but for ``--train.precision``: ``bf16`` (autocast) and ``fp8``
(torchao's float8 Linear layers, tensorwise with power-of-two scales; bf16 autocast for the rest:
attention, norms, the LM head). On a CPU the FP8 GEMMs are emulated (torchao's ``emulate=True``:
the same FP8 rounding of every operand, the products in high precision), so this measures FP8's
numerics, not its speed. The claim checked: the final validation loss of FP8 is within 2% of
bf16's. Each run evaluates every ``--eval-every`` steps on the held-out split.

Writes ``bench/results/fp8_convergence.json`` (both curves, final losses, the ratio, the
command) and ``bench/results/fp8_convergence.png``.

    python bench/fp8_convergence.py [--steps 300] [--layers 2 --hidden 64 --seq-len 64 --batch 16]

The default shape is smaller than the job's own default so that 2 x 300 steps finish in minutes
on a 2-core machine; any shape whose Linear sizes are multiples of 16 converts the same way.
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


def job_command(precision: str, *, args: argparse.Namespace, runs_dir: str) -> list[str]:
    """One ``shardwise train`` run of the built-in job at ``precision``."""
    return [
        sys.executable,
        "-m",
        "shardwise",
        "train",
        f"--train.precision={precision}",
        f"--train.max_steps={args.steps}",
        f"--train.eval_every={args.eval_every}",
        "--train.log_every=10",
        f"--train.global_batch_size={args.batch}",
        f"--train.warmup_steps={args.steps // 10}",
        f"--model.layers={args.layers}",
        f"--model.hidden={args.hidden}",
        f"--model.heads={args.heads}",
        f"--model.seq_len={args.seq_len}",
        f"--data.max_chars={args.max_chars}",
        "--parallel.nproc=1",
        "--sample.chars=0",
        f"--run.name={precision}",
        f"--run.runs_dir={runs_dir}",
        "--checkpoint.every_n_steps=0",
    ]


def run_jobs(precisions: tuple[str, ...], *, args: argparse.Namespace, runs_dir: str) -> dict[str, dict]:
    """The runs side by side (one thread each: they are independent, and a convergence bench
    measures losses, not time); each one's logged training and validation losses."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    procs = {
        p: subprocess.Popen(
            job_command(p, args=args, runs_dir=runs_dir),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for p in precisions
    }
    out = {}
    for precision, proc in procs.items():
        _, stderr = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{precision} run failed ({proc.returncode}):\n{stderr[-3000:]}")
        rows = list(csv.DictReader(open(os.path.join(runs_dir, precision, "metrics.csv"))))
        train = [(int(r["step"]), float(r["loss"])) for r in rows if r.get("loss")]
        val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss")]
        converted = [line.split(" I ", 1)[-1] for line in stderr.splitlines() if "fp8 (" in line]
        out[precision] = {
            "train": train,
            "val": val,
            "final_val_loss": val[-1][1],
            "seconds": time.perf_counter() - start,
            "command": " ".join(["shardwise", *job_command(precision, args=args, runs_dir="RUNS")[3:]]),
            "conversion_log": converted[:1],
        }
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, color in (("bf16", "tab:blue"), ("fp8", "tab:red")):
        run = result["runs"][name]
        ax.plot(*zip(*run["train"]), color=color, alpha=0.5, label=f"{name} train")
        ax.plot(*zip(*run["val"]), "o-", color=color, label=f"{name} validation (final {run['final_val_loss']:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(f"built-in GPT job, FP8 (emulated, tensorwise) vs bf16: final val ratio {result['ratio']:.4f}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-chars", type=int, default=200_000)
    parser.add_argument("--out", default=os.path.join(RESULTS, "fp8_convergence"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fp8-convergence-") as runs_dir:
        runs = run_jobs(("bf16", "fp8"), args=args, runs_dir=runs_dir)
    ratio = runs["fp8"]["final_val_loss"] / runs["bf16"]["final_val_loss"]
    result = {
        "steps": args.steps,
        "shape": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq_len", "batch")},
        "runs": runs,
        "ratio": ratio,
        "within_2_percent": abs(ratio - 1) <= 0.02,
        "command": "python bench/fp8_convergence.py " + " ".join(sys.argv[1:]),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as fh:
        json.dump(result, fh, indent=2)
    plot(result, args.out + ".png")
    print(f"final validation loss: bf16 {runs['bf16']['final_val_loss']:.4f}, fp8 {runs['fp8']['final_val_loss']:.4f}, "
          f"ratio {ratio:.4f} ({'within' if result['within_2_percent'] else 'NOT within'} 2%); {args.out}.json, .png")


if __name__ == "__main__":
    main()
