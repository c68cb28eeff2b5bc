"""Throughput of the Trainer's data-parallel loop, and of a plain loop over ``shardwise.prepare()``,
against a plain hand-written DDP loop (target: >= 0.99 for both).

The loops train the same GPT (same seed) on the same standard-library windows, with the same
global batch, optimizer (AdamW) and precision, on the same processes: 2 Gloo processes on a CPU;
on a GPU machine, bf16 autocast on min(2, GPUs) processes (one GPU: one process, no DDP in
either loop), and then MFU is reported for both. The plain loop is the reference guides' DDP
script done well: DistributedSampler, DataLoader, DDP (same bucket settings as the Trainer),
zero_grad / forward / backward / step, rank 0 reading the loss every 10 steps; the Trainer logs
every 10 steps too (a global loss all-reduce), without its progress bar; the ``prepare()`` loop is
the plain loop on the model, optimizer and loader ``shardwise.prepare`` returns.

Repetitions are interleaved (each repetition runs the three loops back to back, in an order that
rotates from one repetition to the next) so that machine noise hits them alike; each run times
steps ``warmup..steps`` on rank 0 after a device synchronization (samples / wall second) and
measures the **CPU-seconds per step** of the whole run from ``/proc``: every rank reads the user +
system time of its process (all its threads, and any children it reaped: ``/proc/self/stat``
fields 14-17) at both marks, and the ranks' differences are summed, so the figure is what the
run's processes cost per step, whoever else shares the machine; the sum over the threads'
``/proc/self/task/*/schedstat`` run times (nanoseconds instead of clock ticks) is reported beside
it. The result for a loop is the median over the repetitions of its ratio to the plain loop of the
same repetition (adjacent in time, so slow drifts of the machine cancel), with the spread of those
ratios (quartiles, min, max), and the ratio of the medians. Target: the Trainer's CPU per step at
most 1.01 times the plain loop's; its samples per wall second at least 0.99 times. Writes
``bench/results/ddp_throughput.json``.

    python bench/ddp_throughput.py [--reps 15] [--steps 20] [--warmup 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import shardwise
from shardwise.data.corpus import CharWindows, load_stdlib_corpus
from shardwise.models import GPT, GPTConfig


@dataclass(frozen=True)
class BenchSpec:
    layers: int
    hidden: int
    heads: int
    seq_len: int
    global_batch: int
    steps: int
    warmup: int
    reps: int
    precision: str
    lr: float = 1e-3


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(spec: BenchSpec, vocab: int) -> tuple[GPT, GPTConfig]:
    config = GPTConfig(vocab_size=vocab, seq_len=spec.seq_len, layers=spec.layers, hidden=spec.hidden, heads=spec.heads)
    return GPT(config, seed=0), config


def cpu_now() -> tuple[float, float]:
    """(user + system seconds of this process and its reaped children from ``/proc/self/stat``,
    on-CPU seconds summed over this process's threads from ``/proc/self/task/*/schedstat``)."""
    with open("/proc/self/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    ticks = sum(int(v) for v in fields[11:15])  # utime, stime, cutime, cstime (fields 14-17)
    ns = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as fh:
                ns += int(fh.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    return ticks / os.sysconf("SC_CLK_TCK"), ns / 1e9


def mark() -> tuple[float, float, float]:
    """(wall seconds, /proc/self/stat CPU seconds, schedstat CPU seconds) now."""
    return (time.perf_counter(), *cpu_now())


def _rates(spec: BenchSpec, marks: dict[int, tuple[float, float, float]]) -> tuple[float, float, float]:
    """(samples per wall second, CPU-seconds per step of all ranks from /proc/self/stat, the same
    from schedstat) over steps warmup..steps. Every rank calls it (the CPU times are summed)."""
    steps = spec.steps - spec.warmup
    wall = marks[spec.steps][0] - marks[spec.warmup][0]
    cpu = torch.tensor([marks[spec.steps][i] - marks[spec.warmup][i] for i in (1, 2)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(cpu)
    return steps * spec.global_batch / wall, cpu[0].item() / steps, cpu[1].item() / steps


def run_trainer(spec: BenchSpec, dataset: CharWindows, vocab: int) -> tuple[float, float, float, float]:
    """samples/s and CPU-seconds per step (two readings) of steps warmup..steps, and the last logged loss."""
    from shardwise.train import Callback, LoggingOptions, TrainOptions, Trainer

    class Clock(Callback):
        def __init__(self) -> None:
            self.marks: dict[int, tuple[float, float, float]] = {}

        def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
            if trainer.step in (spec.warmup, spec.steps):
                _sync(trainer.env.device)
                self.marks[trainer.step] = mark()

    model, _ = _model(spec, vocab)
    clock = Clock()
    trainer = Trainer(model, loss_fn=lm_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=spec.lr), plan="dp",
                      precision=spec.precision, global_batch_size=spec.global_batch,
                      train=TrainOptions(max_steps=spec.steps, seed=0),
                      logging=LoggingOptions(log_every=10, progress_bar=False), callbacks=[clock])
    result = trainer.fit(dataset)
    return (*_rates(spec, clock.marks), float(result.train_loss or float("nan")))


def run_plain(spec: BenchSpec, dataset: CharWindows, vocab: int, env: Any) -> tuple[float, float, float, float]:
    """The hand-written loop (see the module doc); same measurement."""
    model, _ = _model(spec, vocab)
    model = model.to(env.device)
    if env.world_size > 1:
        model = DDP(
            model,
            device_ids=[env.local_rank] if env.device.type == "cuda" else None,
            bucket_cap_mb=25,
            gradient_as_bucket_view=True,
        )
    sampler = DistributedSampler(
        dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(dataset, batch_size=spec.global_batch // env.world_size, sampler=sampler, drop_last=True,
                        pin_memory=env.device.type == "cuda")

    def epochs() -> Iterator[DataLoader]:
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield loader

    return _loop(spec, model, torch.optim.AdamW(model.parameters(), lr=spec.lr), epochs(), env)


def run_prepared(spec: BenchSpec, dataset: CharWindows, vocab: int, env: Any) -> tuple[float, float, float, float]:
    """The plain loop on what ``shardwise.prepare`` returns (its loader moves to the next epoch by
    itself); same measurement."""
    model, _ = _model(spec, vocab)
    model, optimizer, loader = shardwise.prepare(model, lambda p: torch.optim.AdamW(p, lr=spec.lr), dataset,
                                                 batch_size=spec.global_batch // env.world_size, seed=0)
    return _loop(spec, model, optimizer, itertools.repeat(loader), env)


def _loop(spec: BenchSpec, model: Any, optimizer: torch.optim.Optimizer, epochs: Iterator[Any],
          env: Any) -> tuple[float, float, float, float]:
    """zero_grad / forward / backward / step over the epochs' batches until ``spec.steps``; rank 0
    reads the loss every 10 steps. Returns the rates of steps warmup..steps and the last loss."""
    dtype = torch.bfloat16 if spec.precision == "bf16" else None
    step, marks, last = 0, {}, float("nan")  # marks: step -> (wall, CPU, CPU) seconds
    for loader in epochs:
        for x, y in loader:
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            with torch.autocast(env.device.type, dtype=dtype, enabled=dtype is not None):
                loss = lm_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 10 == 0 and env.is_main:
                last = loss.item()
            if step in (spec.warmup, spec.steps):
                _sync(env.device)
                marks[step] = mark()
            if step == spec.steps:
                return (*_rates(spec, marks), last)
    raise AssertionError("not reached: the epochs never end")


KINDS = ("trainer", "plain", "prepare")


def worker(spec: BenchSpec) -> dict[str, Any]:
    env = shardwise.init()
    if env.device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    corpus = load_stdlib_corpus(max_chars=400_000)
    dataset = CharWindows(corpus.train, spec.seq_len)
    figures: dict[str, dict[str, list[float]]] = {
        k: {"rate": [], "cpu": [], "cpu_sched": [], "loss": []} for k in KINDS
    }
    for rep in range(spec.reps):
        for kind in KINDS[rep % 3:] + KINDS[:rep % 3]:  # each loop first, second and third in turn
            if kind == "trainer":
                got = run_trainer(spec, dataset, corpus.vocab_size)
            elif kind == "plain":
                got = run_plain(spec, dataset, corpus.vocab_size, env)
            else:
                got = run_prepared(spec, dataset, corpus.vocab_size, env)
            for name, value in zip(("rate", "cpu", "cpu_sched", "loss"), got):
                figures[kind][name].append(value)
    from shardwise.train.metrics import peak_flops

    _, config = _model(spec, corpus.vocab_size)
    peak = peak_flops(env.device, spec.precision)
    return {
        "figures": figures,
        "flops_per_sample": config.flops_per_token() * spec.seq_len,
        "peak_flops_per_device": peak,
        "world_size": env.world_size,
        "device": str(env.device),
        "device_name": torch.cuda.get_device_name(env.device)
        if env.device.type == "cuda"
        else platform.processor() or "cpu",
        "params": config.param_count(),
    }


def report_of(result: dict[str, Any], spec: BenchSpec, argv: list[str], started: float) -> dict[str, Any]:
    """The JSON report: per repetition and per loop, samples per wall second and CPU-seconds per
    step (both /proc readings), and for the Trainer and prepare() their ratios to the plain loop."""
    fig = result["figures"]
    med = {k: {n: statistics.median(v) for n, v in fig[k].items() if n != "loss"} for k in KINDS}

    def ratios(name: str) -> dict[str, Any]:
        return {k: spread([a / b for a, b in zip(fig[k][name], fig["plain"][name])]) for k in ("trainer", "prepare")}

    report: dict[str, Any] = {
        "command": "OMP_NUM_THREADS=1 python bench/ddp_throughput.py " + " ".join(argv),
        "spec": asdict(spec),
        "device": result["device_name"],
        "world_size": result["world_size"],
        "params": result["params"],
        # CPU-seconds per optimizer step, all ranks together (user + system, /proc/self/stat)
        "cpu_s_per_step": {k: fig[k]["cpu"] for k in KINDS},
        "median_cpu_s_per_step": {k: med[k]["cpu"] for k in KINDS},
        # per repetition: loop / plain loop of the same repetition; the goal is trainer <= 1.01
        "cpu_per_step_ratio_to_plain": ratios("cpu"),
        "cpu_per_step_ratio_of_medians": {k: med[k]["cpu"] / med["plain"]["cpu"] for k in ("trainer", "prepare")},
        # the same from the threads' schedstat run times (nanosecond resolution)
        "cpu_sched_s_per_step": {k: fig[k]["cpu_sched"] for k in KINDS},
        "cpu_sched_per_step_ratio_to_plain": ratios("cpu_sched"),
        "samples_per_s": {k: fig[k]["rate"] for k in KINDS},
        "median_samples_per_s": {k: med[k]["rate"] for k in KINDS},
        "ratio_to_plain": ratios("rate"),  # samples per wall second: higher is better
        "ratio_of_medians": {k: med[k]["rate"] / med["plain"]["rate"] for k in ("trainer", "prepare")},
        "final_losses": {k: fig[k]["loss"] for k in KINDS},
        "torch": torch.__version__,
        "host": platform.node(),
        "load_average": os.getloadavg(),
        "wall_s": time.time() - started,
    }
    peak = result["peak_flops_per_device"]
    if peak:
        report["mfu"] = {k: med[k]["rate"] * result["flops_per_sample"] / (peak * result["world_size"]) for k in KINDS}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    ap.add_argument("--reps", type=int, default=5 if gpu else 9)
    ap.add_argument("--steps", type=int, default=40 if gpu else 45)
    ap.add_argument("--warmup", type=int, default=10 if gpu else 5)
    ap.add_argument("--nproc", type=int, default=min(2, torch.cuda.device_count()) if gpu else 2)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ddp_throughput.json")
    )
    args = ap.parse_args()
    if gpu:  # GPT-2 small shape with a character vocabulary, bf16
        spec = BenchSpec(layers=12, hidden=768, heads=12, seq_len=512, global_batch=16 * args.nproc, steps=args.steps,
                         warmup=args.warmup, reps=args.reps, precision="bf16", lr=3e-4)
    else:
        spec = BenchSpec(
            layers=2,
            hidden=128,
            heads=4,
            seq_len=64,
            global_batch=32,
            steps=args.steps,
            warmup=args.warmup,
            reps=args.reps,
            precision="fp32",
        )
    started = time.time()
    result = shardwise.launch(worker, nprocs=args.nproc, args=(spec,), timeout_s=1800)[0]
    report = report_of(result, spec, sys.argv[1:], started)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(
        f"{result['world_size']} process(es) on {result['device_name']}, {spec.precision}, GPT {result['params']:,} "
        f"params, global batch {spec.global_batch} x {spec.seq_len} tokens, {args.reps} interleaved repetitions of "
        f"{spec.steps - spec.warmup} timed steps"
    )
    for kind in KINDS:
        mfu = f", MFU {report['mfu'][kind]:.1%}" if "mfu" in report else ""
        print(f"  {kind:<8} median {report['median_cpu_s_per_step'][kind] * 1e3:7.2f} CPU-ms per step (all ranks), "
              f"{report['median_samples_per_s'][kind]:8.1f} samples/s{mfu}")
    for kind in ("trainer", "prepare"):
        c, q, r = (report["cpu_per_step_ratio_to_plain"][kind], report["cpu_sched_per_step_ratio_to_plain"][kind],
                   report["ratio_to_plain"][kind])
        print(
            f"{kind} / plain DDP, CPU per step: {c['median']:.4f} (median of {args.reps} interleaved ratios, 95% "
            f"interval {c['median_ci95'][0]:.4f}-{c['median_ci95'][1]:.4f}; quartiles {c['q1']:.4f}-{c['q3']:.4f}, "
            f"range {c['min']:.4f}-{c['max']:.4f}; goal <= 1.01), schedstat {q['median']:.4f} "
            f"({q['q1']:.4f}-{q['q3']:.4f}); samples per wall second {r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f})"
        )
    print(f"wrote {args.out}")


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles and range of ``values``, and a 95% bootstrap interval of the median (2000
    resamples, fixed seed): how far the median itself may be off with this many repetitions."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(2000))
    return {
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "median_ci95": [medians[49], medians[1949]],
    }


if __name__ == "__main__":
    main()
