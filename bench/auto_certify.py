"""What certifying a ``plan="auto"`` choice costs, against a run of 1,000 steps.

For each model (an MLP, a small CNN, a Hugging Face Llama and Mixtral built from tiny configs, and
shardwise's GPT at 8 blocks, which certification cuts to 2), ``Trainer(plan="auto",
                                                                       parallel=ParallelOptions(certify=True))``
trains for ``--steps`` steps on 2 local Gloo processes (the planner uses the ``cpu`` preset, so
nothing is calibrated). From the same processes, the bench takes the certificate's own time (the
shrunken copy, the single-process reference and every candidate) and the median training step
after the first few, and reports

    overhead = certification seconds / (1000 x median step seconds)

which must stay under 5%. The same run with one candidate broken on purpose (rank 1 scales its
gradient) shows the cost of a refusal and a fallback. Writes ``bench/results/auto_certify.json``::

    python bench/auto_certify.py                 # about 3 minutes on a 2-core VM
    python bench/auto_certify.py --models mlp gpt --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MODELS = ("mlp", "cnn", "llama", "mixtral", "gpt")
BROKEN: list[str] = []


def make(kind: str):  # noqa: ANN201
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    ce = nn.functional.cross_entropy
    if kind == "mlp":
        x = torch.randn(4096, 64, generator=g)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        return model, TensorDataset(x, x[:, :10].argmax(1)), ce, 64
    if kind == "cnn":
        x = torch.randn(2048, 3, 16, 16, generator=g)
        stages = nn.Sequential(
            *[nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU()) for _ in range(4)]
        )
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)
        )
        return model, TensorDataset(x, (x.mean((1, 2, 3)) > 0).long()), ce, 32
    if kind == "gpt":
        from shardwise.models.gpt import GPT, GPTConfig

        cfg = GPTConfig(vocab_size=256, seq_len=128, layers=8, hidden=128, heads=4)
        ids = torch.randint(0, 256, (1024, 129), generator=g)
        return (
            GPT(cfg, seed=0),
            TensorDataset(ids[:, :-1], ids[:, 1:]),
            lambda out, y: ce(out.flatten(0, 1), y.flatten()),
            16,
        )
    from shardwise.models.hf import build_causal_lm, lm_loss, tiny_config

    model = build_causal_lm(tiny_config(kind, layers=6, hidden=64, heads=4, kv_heads=2, vocab=256, seq=64), seed=0)
    ids = torch.randint(0, 256, (1024, 65), generator=g)
    return model, TensorDataset(ids[:, :-1], ids[:, 1:]), lm_loss, 16


def break_first(pm, plan) -> None:  # noqa: ANN001
    import torch.distributed as dist

    if BROKEN and BROKEN[0] != str(plan):
        return
    BROKEN[:1] = [str(plan)]
    if dist.get_rank() == 1:
        p = next(q for q in pm.parameters() if q.grad is not None)
        (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(1.5)


def worker(kind: str, steps: int, broken: bool) -> dict:
    import torch

    from shardwise.train import LoggingOptions, ParallelOptions, TrainOptions, Trainer
    from shardwise.auto.certify import CertifyOptions

    torch.set_num_threads(1)
    BROKEN.clear()
    model, data, loss, batch = make(kind)
    trainer = Trainer(
        model,
        loss_fn=loss,
        plan="auto",
        global_batch_size=batch,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        train=TrainOptions(max_steps=steps),
        parallel=ParallelOptions(
            cluster="cpu", certify=CertifyOptions(enabled=True, after_backward=break_first if broken else None)
        ),
        logging=LoggingOptions(log_every=1, progress_bar=False),
    )
    start = time.perf_counter()
    trainer.setup(data)
    setup_s = time.perf_counter() - start
    result = trainer.fit(data)
    times = [row["step_time_s"] for row in result.history if "step_time_s" in row][3:]
    cert = trainer.auto_choice.certificate if trainer.auto_choice is not None else None
    return {"plan": str(trainer.plan), "setup_s": setup_s, "step_s": statistics.median(times), "certificate": cert,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> int:
    from shardwise.launch.inprocess import launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "auto_certify.json"))
    args = parser.parse_args()
    rows = []
    for kind in args.models:
        for broken in (False, True):
            if broken and kind not in ("mlp", "gpt"):
                continue
            got = launch(worker, nprocs=args.nproc, args=(kind, args.steps, broken), backend="gloo", timeout_s=900)[0]
            cert = got["certificate"]
            run_s = 1000 * got["step_s"]
            row = {"model": kind, "params": got["params"], "broken_on_purpose": broken, "plan": got["plan"],
                   "certified_model": cert["compared"]["model"], "candidates": [c["plan"] for c in cert["candidates"]],
                   "refused": [c["failed"] for c in cert["candidates"] if not c["passed"]],
                   "certification_s": cert["seconds"], "setup_s": got["setup_s"], "median_step_s": got["step_s"],
                   "run_1000_steps_s": run_s, "overhead_of_1000_steps": cert["seconds"] / run_s}
            rows.append(row)
            print(f"{kind:8} {'broken ' if broken else ''}{got['plan']:<24} certification {cert['seconds']:.2f} s "
                  f"({len(cert['candidates'])} candidate(s)), step {1e3 * got['step_s']:.1f} ms -> "
                  f"{100 * row['overhead_of_1000_steps']:.2f}% of 1000 steps", flush=True)
    out = {
        "nproc": args.nproc,
        "steps": args.steps,
        "cpu_count": os.cpu_count(),
        "rows": rows,
        "max_overhead_unbroken": max(
            (r["overhead_of_1000_steps"] for r in rows if not r["broken_on_purpose"]), default=None
        ),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
