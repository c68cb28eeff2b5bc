"""Per-rank peak memory and step time of the runtime options (``params16``, ``chunked_loss``,
``sharded_accumulation``), with and without each, against the planner's prediction of the same
plan.

Models: the built-in GPT and a Hugging Face Llama (built from a config; nothing is downloaded),
each with a vocabulary large enough that the loss matters (``--vocab``). Layouts, on 2 Gloo
processes: ``zero=3`` with 2 accumulation steps, ``tp=2``, ``pp=2`` (1F1B, 2 microbatches). For
each layout: fp32 without options, with ``chunked_loss`` and (zero=3) with
``sharded_accumulation``; bf16 under autocast without options and with ``params16``.

Measured, through the Trainer (AdamW, token reduction):

- **peak memory**: the bytes of every tensor storage alive when a step starts (found by the
  garbage collector: parameters, optimizer state, what persists), plus the largest rise of
  allocated bytes during that step: torch's profiler with ``profile_memory`` records every CPU
  allocation and free with the CPU allocator's running total of allocated bytes, which counts
  the frees of every thread (c10's ``caffe2_report_cpu_memory_usage`` switched on, as torch's
  profiler alone sees only the threads it profiles: a Gloo worker thread that drops the last
  reference to a collective's buffer would otherwise leave that buffer counted to the step's
  end, at random, on one rank in some repeats). The busiest rank, and the largest over the
  ``--repeats`` rounds (each round profiles one step). The process's own baseline (libraries,
  the interpreter) is not a tensor and not counted, nor by the planner.
- **step time**: the median of ``--steps`` steps after 2 warm-up steps (before the profiled one), runs interleaved
  (``--repeats`` rounds over the options of a layout), the median over the rounds.

Predicted: :func:`shardwise.plan.cost.estimate` of the plan (its runtime options folded in by
``RunPolicy.applied``; accumulation as ``microbatches``) on the ``cpu`` preset with
``StatePolicy.torch(precision, "adam")``: the total memory of the busiest rank and the step time.
Reported: measured, predicted, predicted/measured memory (the goal: within 10%), each option's
measured and predicted step-time ratio to its layout's baseline. Writes
bench/results/runtime_options.json and .png.

Run:  .venv/bin/python bench/runtime_options.py [--vocab 8192] [--repeats 2] [--steps 4] [--models gpt,llama]
      .venv/bin/python bench/runtime_options.py --layouts pp=2  # re-measure one layout, keep the others' rows
      .venv/bin/python bench/runtime_options.py --repredict   # the same measurements, the planner's current predictions
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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "src"))

SEQ, HIDDEN, LAYERS, HEADS, BATCH = 128, 128, 2, 4, 8
LAYOUTS = {
    "zero=3": ("zero=3,shard=2", 2),
    "tp=2": ("tp=2", 1),
    "pp=2": ("pp=2,microbatches=2,schedule=1f1b", 1),
}  # plan, accumulation


def options_of(layout: str) -> list[tuple[str, str]]:
    """(label, plan suffix) of the runs of a layout, the first of each precision its baseline."""
    runs = [("fp32", ""), ("fp32 +chunked_loss", ",chunked_loss")]
    if layout == "zero=3":
        runs.append(("fp32 +sharded_accumulation", ",sharded_accumulation"))
    return runs + [("bf16", ",precision=bf16"), ("bf16 +params16", ",precision=bf16,params16")]


def build_model(model: str, vocab: int) -> Any:
    if model == "gpt":
        from shardwise.models.gpt import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=vocab, seq_len=SEQ, layers=LAYERS, hidden=HIDDEN, heads=HEADS), seed=0)
    from shardwise.models import hf

    return hf.build_causal_lm(
        hf.tiny_config("llama", vocab=vocab, hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=2, seq=SEQ), seed=0
    )


def model_stats(model: str, vocab: int) -> Any:
    if model == "gpt":
        from shardwise.models.gpt import GPTConfig
        from shardwise.plan.stats import transformer_stats

        return transformer_stats(GPTConfig(vocab_size=vocab, seq_len=SEQ, layers=LAYERS, hidden=HIDDEN, heads=HEADS))
    from shardwise.models import hf

    return hf.stats_of_config(
        hf.tiny_config("llama", vocab=vocab, hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=2, seq=SEQ), seq=SEQ
    )


def _loss(output: Any, targets: Any) -> Any:
    import torch.nn.functional as F

    from shardwise.models.hf import logits_of

    return F.cross_entropy(logits_of(output).flatten(0, -2).float(), targets.flatten(), ignore_index=-100)


def live_tensor_bytes() -> float:
    """Bytes of every CPU tensor storage alive now (found by the garbage collector, each storage
    once; a DTensor by its local tensor): between steps, the model states and what persists."""
    import gc
    import warnings

    import torch
    from torch.distributed.tensor import DTensor

    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on torch.distributed's deprecated aliases warns
        for obj in gc.get_objects():
            if not isinstance(obj, torch.Tensor):
                continue
            t = obj._local_tensor if isinstance(obj, DTensor) else obj
            if t.is_meta or t.device.type != "cpu":
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return float(sum(seen.values()))


def count_every_thread() -> None:
    """Make the CPU allocator count every allocation and free of this process, whichever thread
    makes it (c10's ``caffe2_report_cpu_memory_usage`` flag, a global of libc10 with no Python
    setter), so that the profiler's running total includes frees made outside the profiled threads."""
    import ctypes

    import torch

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def peak_delta_bytes(prof: Any) -> float:
    """The largest rise of allocated CPU bytes during the profiled step over its start: the CPU
    allocator's total of allocated bytes (every thread's, :func:`count_every_thread`) at each of
    the profiler's allocation and free records, less the total before the first one."""
    records: list[tuple[int, int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        fields = node.extra_fields
        if type(fields).__name__ == "_ExtraFields_Allocation" and fields.device.type == "cpu":
            records.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
    if not records:
        return 0.0
    records.sort()
    start = records[0][2] - records[0][1]
    return float(max(0, max(total for _, _, total in records) - start))


def measure(model: str, vocab: int, plan: str, accumulation: int, steps: int, profile: bool) -> dict[str, Any]:
    """On every rank: train ``steps + 2`` steps (+1 profiled); step times and this rank's peak."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.utils.data import TensorDataset

    from shardwise.train import Callback, DataOptions, LoggingOptions, TrainOptions, Trainer

    import gc

    gc.collect()  # the previous configuration's objects, before this one allocates
    count_every_thread()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (BATCH * (steps + 4), SEQ + 1), generator=gen)
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    total = steps + 2 + int(profile)

    class Clock(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = 0.0
            self.prof: Any = None
            self.peak: dict[str, float] = {}

        def on_step_end(self, trainer: Any, metrics: Any) -> None:
            now = time.perf_counter()
            step = trainer.step
            if self.prof is not None:  # the profiled step just ended
                self.prof.stop()
                self.peak["step"] = peak_delta_bytes(self.prof)
                self.peak["total"] = self.peak["live"] + self.peak["step"]
                self.prof = None
            elif step > 2:
                self.times.append(now - self.last)
            if profile and step == total - 1:
                self.peak["live"] = live_tensor_bytes()
                self.prof = torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self.prof.start()
            self.last = time.perf_counter()

    clock = Clock()
    trainer = Trainer(build_model(model, vocab), loss_fn=_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                      plan=plan, global_batch_size=BATCH,
                      train=TrainOptions(grad_accum_steps=accumulation, max_steps=total, loss_reduction="tokens"),
                      data=DataOptions(shuffle=False), logging=LoggingOptions(log_every=1000, progress_bar=False),
                      callbacks=[clock])
    trainer.fit(data)
    return {"times": clock.times, "peak": clock.peak, "plan": str(trainer.plan)}


def predict(model: str, vocab: int, plan_text: str, accumulation: int) -> dict[str, float]:
    from dataclasses import replace

    from shardwise.layout import Plan
    from shardwise.plan.cluster import resolve
    from shardwise.plan.cost import StatePolicy, estimate

    plan = Plan.parse(plan_text, world_size=2)
    if accumulation > 1:
        plan = replace(plan, microbatches=accumulation)  # the planner's accumulation is its microbatches
    est = estimate(model_stats(model, vocab), resolve("cpu", devices=2, devices_per_node=2), plan, global_batch=BATCH,
                   policy=StatePolicy.torch(plan.precision, "adam"))
    return {"total": est.memory_total, **{k: float(v) for k, v in est.memory.items()}, "step_time_s": est.step_time_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument(
        "--layouts",
        default=",".join(LAYOUTS),
        help="measure only these layouts (';'-separated or ','-separated keys of "
        "the layout table); the rows of the others are kept from bench/results/runtime_options.json",
    )
    parser.add_argument(
        "--repredict",
        action="store_true",
        help="keep the measurements of bench/results/runtime_options.json, predict again (after a planner change)",
    )
    args = parser.parse_args()
    path = os.path.join(RESULTS, "runtime_options.json")
    if args.repredict:
        with open(path) as fh:
            old = json.load(fh)
        finish(old["rows"], command=old["command"], vocab=old["shape"]["vocab"], path=path)
        return 0
    layouts = [x for x in args.layouts.replace(";", ",").split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        print(f"--layouts: {', '.join(unknown)} unknown; use {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    from shardwise.testing import WorkerPool

    pool = WorkerPool(2, timeout_s=900)
    rows: list[dict[str, Any]] = []
    try:
        for model in args.models.split(","):
            for layout, (plan, accumulation) in LAYOUTS.items():
                if layout not in layouts:
                    continue
                runs = options_of(layout)
                times: dict[str, list[float]] = {label: [] for label, _ in runs}
                peaks: dict[str, dict[str, Any]] = {}
                for _ in range(args.repeats):  # interleaved: every option once per round
                    for label, suffix in runs:
                        ranks = pool.run(measure, model, args.vocab, plan + suffix, accumulation, args.steps, True)
                        times[label].append(statistics.median(ranks[0]["times"]))
                        got = peaks.setdefault(label, {"plan": ranks[0]["plan"], "rounds": []})
                        got["rounds"].append([r["peak"]["total"] for r in ranks])
                        if max(got["rounds"][-1]) >= max(max(x) for x in got["rounds"]):  # the busiest round so far
                            got["peak"] = ranks[0]["peak"]
                        print(
                            f"{model} {layout} {label}: {times[label][-1] * 1e3:.0f} ms/step, peak "
                            f"{max(got['rounds'][-1]) / 2**20:.1f} MiB",
                            flush=True,
                        )
                for label, suffix in runs:
                    got = peaks[label]
                    rows.append(
                        {
                            "model": model,
                            "layout": layout,
                            "option": label,
                            "plan_text": plan + suffix,
                            "plan": got["plan"],
                            "accumulation": accumulation,
                            "step_time_s": statistics.median(times[label]),
                            "step_times_s": times[label],
                            "measured_peak_bytes": max(max(x) for x in got["rounds"]),
                            "measured_rank_peaks": [
                                max(x[i] for x in got["rounds"]) for i in range(len(got["rounds"][0]))
                            ],
                            "measured_round_peaks": got["rounds"],
                            "measured_rank0": got["peak"],
                            "baseline": "fp32" if label.startswith("fp32") else "bf16",
                        }
                    )
    finally:
        pool.close()
    command = (
        f"bench/runtime_options.py --vocab {args.vocab} --repeats {args.repeats} --steps {args.steps} --models "
        f"{args.models}"
    )
    if set(layouts) != set(LAYOUTS):  # a partial run: the other layouts' rows as last measured
        with open(path) as fh:
            old = json.load(fh)
        kept = [r for r in old["rows"] if r["layout"] not in layouts]
        for r in kept:
            r.setdefault("measured_by", old["command"])
        for r in rows:
            r["measured_by"] = command + f" --layouts {','.join(layouts)}"
        order = {(m, lay): i for i, (m, lay) in enumerate((m, lay) for m in args.models.split(",") for lay in LAYOUTS)}
        rows = sorted(kept + rows, key=lambda r: order.get((r["model"], r["layout"]), len(order)))
        command = old["command"] + f"; {command} --layouts {','.join(layouts)}"
    finish(rows, command=command, vocab=args.vocab, path=path)
    return 0


def finish(rows: list[dict[str, Any]], *, command: str, vocab: int, path: str) -> None:
    """The planner's predictions of the measured rows, the ratios, the JSON, the table, the PNG."""
    for r in rows:
        want = predict(r["model"], vocab, r.get("plan_text") or r["plan"], r["accumulation"])
        r["predicted"] = want
        r["predicted_over_measured"] = want["total"] / r["measured_peak_bytes"]
    by_key = {(r["model"], r["layout"], r["option"]): r for r in rows}
    for r in rows:
        base = by_key[(r["model"], r["layout"], r["baseline"])]
        r["measured_time_ratio"] = r["step_time_s"] / base["step_time_s"]
        r["predicted_time_ratio"] = r["predicted"]["step_time_s"] / base["predicted"]["step_time_s"]
        r["measured_memory_ratio"] = r["measured_peak_bytes"] / base["measured_peak_bytes"]
        r["predicted_memory_ratio"] = r["predicted"]["total"] / base["predicted"]["total"]
    out = {
        "command": command,
        "shape": {
            "seq": SEQ,
            "hidden": HIDDEN,
            "layers": LAYERS,
            "heads": HEADS,
            "vocab": vocab,
            "global_batch": BATCH,
        },
        "within_10_percent": sum(abs(r["predicted_over_measured"] - 1) <= 0.10 for r in rows),
        "configurations": len(rows),
        "rows": rows,
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(out, fh, indent=2)
    print(
        f"\n{'model':6s} {'layout':7s} {'option':27s} {'peak MiB':>9s} {'pred MiB':>9s} {'pred/meas':>9s} "
        f"{'ms/step':>8s} {'time x':>7s} {'pred x':>7s} {'mem x':>6s} {'pred x':>6s}"
    )
    for r in rows:
        print(
            f"{r['model']:6s} {r['layout']:7s} {r['option']:27s} {r['measured_peak_bytes'] / 2**20:9.1f} "
            f"{r['predicted']['total'] / 2**20:9.1f} {r['predicted_over_measured']:9.2f} {r['step_time_s'] * 1e3:8.0f} "
            f"{r['measured_time_ratio']:7.2f} {r['predicted_time_ratio']:7.2f} {r['measured_memory_ratio']:6.2f} "
            f"{r['predicted_memory_ratio']:6.2f}"
        )
    print(f"memory within 10% of the prediction: {out['within_10_percent']} of {len(rows)}")
    _plot(rows)


def _plot(rows: list[dict[str, Any]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(models), 1, figsize=(12, 4.2 * len(models)), squeeze=False)
    for ax, model in zip(axes[:, 0], models):
        mine = [r for r in rows if r["model"] == model]
        xs = range(len(mine))
        ax.bar(
            [x - 0.2 for x in xs], [r["measured_peak_bytes"] / 2**20 for r in mine], width=0.4, label="measured peak"
        )
        ax.bar([x + 0.2 for x in xs], [r["predicted"]["total"] / 2**20 for r in mine], width=0.4, label="predicted")
        for x, r in zip(xs, mine):
            ax.text(
                x,
                r["measured_peak_bytes"] / 2**20,
                f"{r['measured_time_ratio']:.2f}x",
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['layout']}\n{r['option']}" for r in mine], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("MiB per rank (busiest)")
        ax.set_title(
            f"{model}: peak memory per rank, measured vs predicted (labels: step time vs the layout's baseline)"
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "runtime_options.png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
