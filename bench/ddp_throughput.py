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
steps ``warmup..steps`` (samples / seconds, measured on rank 0 after a device synchronization).
The result for a loop is the median over the repetitions of its ratio to the plain loop of the
same repetition (adjacent in time, so slow drifts of the machine cancel), with the spread of those
ratios (quartiles, min, max); the ratio of the medians is printed too, and the same figures per
CPU-second of rank 0 (what the loop costs in compute, which a machine shared with other jobs does
not distort the way it distorts wall time). Writes ``bench/results/ddp_throughput.json``.

    python bench/ddp_throughput.py [--reps 15] [--steps 20] [--warmup 5]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch
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


def _rates(spec: BenchSpec, marks: dict[int, tuple[float, float]]) -> tuple[float, float]:
    """(samples per wall second, samples per CPU-second of this process) over steps warmup..steps."""
    samples = (spec.steps - spec.warmup) * spec.global_batch
    wall = marks[spec.steps][0] - marks[spec.warmup][0]
    cpu = marks[spec.steps][1] - marks[spec.warmup][1]
    return samples / wall, samples / max(cpu, 1e-9)


def run_trainer(spec: BenchSpec, dataset: CharWindows, vocab: int) -> tuple[float, float, float]:
    """samples/s and samples per CPU-second of steps warmup..steps, and the last logged loss."""
    from shardwise.train import Callback, LoggingOptions, TrainOptions, Trainer

    class Clock(Callback):
        def __init__(self) -> None:
            self.marks: dict[int, tuple[float, float]] = {}

        def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
            if trainer.step in (spec.warmup, spec.steps):
                _sync(trainer.env.device)
                self.marks[trainer.step] = (time.perf_counter(), time.process_time())

    model, _ = _model(spec, vocab)
    clock = Clock()
    trainer = Trainer(model, loss_fn=lm_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=spec.lr), plan="dp",
                      precision=spec.precision, global_batch_size=spec.global_batch,
                      train=TrainOptions(max_steps=spec.steps, seed=0),
                      logging=LoggingOptions(log_every=10, progress_bar=False), callbacks=[clock])
    result = trainer.fit(dataset)
    return (*_rates(spec, clock.marks), float(result.train_loss or float("nan")))


def run_plain(spec: BenchSpec, dataset: CharWindows, vocab: int, env: Any) -> tuple[float, float, float]:
    """The hand-written loop (see the module doc); same measurement."""
    model, _ = _model(spec, vocab)
    model = model.to(env.device)
    if env.world_size > 1:
        model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None, bucket_cap_mb=25, gradient_as_bucket_view=True)
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=spec.global_batch // env.world_size, sampler=sampler, drop_last=True,
                        pin_memory=env.device.type == "cuda")

    def epochs() -> Iterator[DataLoader]:
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            yield loader

    return _loop(spec, model, torch.optim.AdamW(model.parameters(), lr=spec.lr), epochs(), env)


def run_prepared(spec: BenchSpec, dataset: CharWindows, vocab: int, env: Any) -> tuple[float, float, float]:
    """The plain loop on what ``shardwise.prepare`` returns (its loader moves to the next epoch by
    itself); same measurement."""
    model, _ = _model(spec, vocab)
    model, optimizer, loader = shardwise.prepare(model, lambda p: torch.optim.AdamW(p, lr=spec.lr), dataset,
                                                 batch_size=spec.global_batch // env.world_size, seed=0)
    return _loop(spec, model, optimizer, itertools.repeat(loader), env)


def _loop(spec: BenchSpec, model: Any, optimizer: torch.optim.Optimizer, epochs: Iterator[Any], env: Any) -> tuple[float, float, float]:
    """zero_grad / forward / backward / step over the epochs' batches until ``spec.steps``; rank 0
    reads the loss every 10 steps. Returns the rates of steps warmup..steps and the last loss."""
    dtype = torch.bfloat16 if spec.precision == "bf16" else None
    step, marks, last = 0, {}, float("nan")  # marks: step -> (wall, CPU) seconds
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
                marks[step] = (time.perf_counter(), time.process_time())
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
    rates: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu_rates: dict[str, list[float]] = {k: [] for k in KINDS}
    losses: dict[str, list[float]] = {k: [] for k in KINDS}
    for rep in range(spec.reps):
        for kind in KINDS[rep % 3:] + KINDS[:rep % 3]:  # each loop first, second and third in turn
            if kind == "trainer":
                rate, cpu_rate, loss = run_trainer(spec, dataset, corpus.vocab_size)
            elif kind == "plain":
                rate, cpu_rate, loss = run_plain(spec, dataset, corpus.vocab_size, env)
            else:
                rate, cpu_rate, loss = run_prepared(spec, dataset, corpus.vocab_size, env)
            rates[kind].append(rate)
            cpu_rates[kind].append(cpu_rate)
            losses[kind].append(loss)
    from shardwise.train.metrics import peak_flops

    _, config = _model(spec, corpus.vocab_size)
    peak = peak_flops(env.device, spec.precision)
    return {"rates": rates, "cpu_rates": cpu_rates, "losses": losses, "flops_per_sample": config.flops_per_token() * spec.seq_len,
            "peak_flops_per_device": peak, "world_size": env.world_size, "device": str(env.device),
            "device_name": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else platform.processor() or "cpu",
            "params": config.param_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = torch.cuda.is_available()
    ap.add_argument("--reps", type=int, default=5 if gpu else 15)
    ap.add_argument("--steps", type=int, default=40 if gpu else 20)
    ap.add_argument("--warmup", type=int, default=10 if gpu else 5)
    ap.add_argument("--nproc", type=int, default=min(2, torch.cuda.device_count()) if gpu else 2)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ddp_throughput.json"))
    args = ap.parse_args()
    if gpu:  # GPT-2 small shape with a character vocabulary, bf16
        spec = BenchSpec(layers=12, hidden=768, heads=12, seq_len=512, global_batch=16 * args.nproc, steps=args.steps,
                         warmup=args.warmup, reps=args.reps, precision="bf16", lr=3e-4)
    else:
        spec = BenchSpec(layers=2, hidden=128, heads=4, seq_len=64, global_batch=32, steps=args.steps, warmup=args.warmup,
                         reps=args.reps, precision="fp32")
    started = time.time()
    result = shardwise.launch(worker, nprocs=args.nproc, args=(spec,), timeout_s=900)[0]
    rates, cpu_rates = result["rates"], result["cpu_rates"]
    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_rates.items()}
    ratios = {k: spread([a / b for a, b in zip(rates[k], rates["plain"])]) for k in ("trainer", "prepare")}
    cpu_ratios = {k: spread([a / b for a, b in zip(cpu_rates[k], cpu_rates["plain"])]) for k in ("trainer", "prepare")}
    report: dict[str, Any] = {
        "command": "OMP_NUM_THREADS=1 python bench/ddp_throughput.py " + " ".join(sys.argv[1:]),
        "spec": asdict(spec),
        "device": result["device_name"],
        "world_size": result["world_size"],
        "params": result["params"],
        "samples_per_s": rates,
        "median_samples_per_s": med,
        "ratio_to_plain": ratios,  # per repetition: loop / plain loop of the same repetition
        "ratio_of_medians": {k: med[k] / med["plain"] for k in ("trainer", "prepare")},
        # the fastest repetition of each loop: the one least disturbed by other jobs (timeit's rule)
        "ratio_of_best": {k: max(rates[k]) / max(rates["plain"]) for k in ("trainer", "prepare")},
        "samples_per_cpu_s_rank0": cpu_rates,
        "cpu_ratio_to_plain": cpu_ratios,
        "cpu_ratio_of_medians": {k: cpu_med[k] / cpu_med["plain"] for k in ("trainer", "prepare")},
        "final_losses": result["losses"],
        "torch": torch.__version__,
        "host": platform.node(),
        "load_average": os.getloadavg(),
        "wall_s": time.time() - started,
    }
    peak = result["peak_flops_per_device"]
    if peak:
        total = peak * result["world_size"]
        report["mfu"] = {k: v * result["flops_per_sample"] / total for k, v in med.items()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2)
    print(f"{result['world_size']} process(es) on {result['device_name']}, {spec.precision}, GPT {result['params']:,} params, "
          f"global batch {spec.global_batch} x {spec.seq_len} tokens, {args.reps} interleaved repetitions of {spec.steps - spec.warmup} timed steps")
    for kind in KINDS:
        mfu = f", MFU {report['mfu'][kind]:.1%}" if "mfu" in report else ""
        print(f"  {kind:<8} median {med[kind]:8.1f} samples/s  (reps: {', '.join(f'{r:.1f}' for r in rates[kind])}){mfu}; "
              f"{cpu_med[kind]:.1f} samples per CPU-second of rank 0")
    for kind in ("trainer", "prepare"):
        r, c = ratios[kind], cpu_ratios[kind]
        print(f"{kind} / plain DDP: {r['median']:.3f} wall (median of {args.reps} interleaved ratios; quartiles {r['q1']:.3f}-{r['q3']:.3f}, "
              f"range {r['min']:.3f}-{r['max']:.3f}; target >= 0.99), ratio of the medians {report['ratio_of_medians'][kind]:.3f}, "
              f"of the fastest repetitions {report['ratio_of_best'][kind]:.3f}; "
              f"per CPU-second of rank 0 {c['median']:.3f} (quartiles {c['q1']:.3f}-{c['q3']:.3f})")
    print(f"wrote {args.out}")


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles and range of ``values``."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values), "n": len(values)}


if __name__ == "__main__":
    main()
