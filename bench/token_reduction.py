"""What ``loss_reduction="tokens"`` costs against ``"samples"``: one all-reduce of one integer per
step, and counting the targets (target: a step-time ratio within noise of 1.0).

The same GPT (same seed) trains on the same ragged-masked token windows under ``plan=dp=2`` with
gradient accumulation 2, with each reduction, on 2 Gloo processes (on a GPU machine: NCCL on
min(2, GPUs) processes). Repetitions are interleaved (tokens, samples, samples, tokens, ...) so that
machine noise hits both alike; each repetition is one ``fit`` whose steps after ``warmup`` are
timed on rank 0 (the Trainer's own ``step_time_s``, logged every step). The result is the median
of the per-pair ratios (tokens / samples), the ratio of the medians, and rank 0's CPU seconds per
step (which a machine shared with other jobs does not distort the way it distorts wall time).
Writes ``bench/results/token_reduction.json``.

    python bench/token_reduction.py [--reps 6] [--steps 12] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import shardwise
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.train import Callback, DataOptions, LoggingOptions, TrainOptions, Trainer
from shardwise.verify.workloads import ragged_mask

SHAPE = GPTConfig(vocab_size=256, seq_len=128, layers=2, hidden=128, heads=4)


class StepTimes(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu: list[float] = []
        self._cpu = time.process_time()

    def on_step_end(self, trainer, metrics) -> None:
        now = time.process_time()
        self.times.append(metrics["step_time_s"])
        self.cpu.append(now - self._cpu)
        self._cpu = now


def one_fit(reduction: str, steps: int, global_batch: int) -> dict[str, list[float]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, SHAPE.vocab_size, (global_batch * steps, SHAPE.seq_len + 1), generator=gen)
    data = TensorDataset(ids[:, :-1], ragged_mask(ids[:, 1:], gen))
    rec = StepTimes()
    trainer = Trainer(GPT(SHAPE, seed=0), loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                      plan="dp", global_batch_size=global_batch,
                      train=TrainOptions(grad_accum_steps=2, max_steps=steps, loss_reduction=reduction),
                      data=DataOptions(shuffle=False), logging=LoggingOptions(log_every=1, progress_bar=False),
                      callbacks=[rec])
    trainer.fit(data)
    return {"wall": rec.times, "cpu": rec.cpu}


def worker(reps: int, steps: int, warmup: int, global_batch: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"tokens": [], "samples": [], "tokens_cpu": [], "samples_cpu": []}
    for rep in range(reps):
        order = ("tokens", "samples") if rep % 2 == 0 else ("samples", "tokens")
        for reduction in order:
            got = one_fit(reduction, steps, global_batch)
            out[reduction].append(statistics.median(got["wall"][warmup:]))
            out[f"{reduction}_cpu"].append(statistics.median(got["cpu"][warmup:]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=16)
    args = parser.parse_args()
    nproc = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2
    results = shardwise.launch(
        worker, nprocs=nproc, args=(args.reps, args.steps, args.warmup, args.global_batch), timeout_s=3600
    )
    r = results[0]
    pairs = [t / s for t, s in zip(r["tokens"], r["samples"])]
    summary = {
        "command": f"python bench/token_reduction.py --reps {args.reps} --steps {args.steps} --warmup {args.warmup}",
        "machine": platform.node(),
        "processes": nproc,
        "model": f"GPT {SHAPE.layers}x{SHAPE.hidden}, seq {SHAPE.seq_len}",
        "global_batch": args.global_batch,
        "grad_accum_steps": 2,
        "plan": f"dp={nproc}",
        "median_pair_ratio_wall": statistics.median(pairs),
        "ratio_of_medians_wall": statistics.median(r["tokens"]) / statistics.median(r["samples"]),
        "ratio_of_medians_cpu": statistics.median(r["tokens_cpu"]) / statistics.median(r["samples_cpu"]),
        "step_time_s": {"tokens": r["tokens"], "samples": r["samples"]},
        "cpu_s_per_step_rank0": {"tokens": r["tokens_cpu"], "samples": r["samples_cpu"]},
        "load_average": os.getloadavg(),
    }
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "token_reduction.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    print(json.dumps({k: v for k, v in summary.items() if "ratio" in k or k in ("command", "load_average")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
