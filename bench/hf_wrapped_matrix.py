"""Parity of Hugging Face models in a user's own wrapper, every family under every plan: models
shardwise did not build.

Each family of :data:`shardwise.models.hf.FAMILIES` (tiny configs: 4 layers, hidden 32, nothing
downloaded) is wrapped as a new user writes it, ``forward(ids) -> self.model(ids).logits``
(``examples/hf_wrapped_script.py``), once with ``sdpa`` and once with ``eager`` attention, and
trained under the plans of ``bench/hf_parity_matrix.py`` plus ``cp=2``, ``ep=2`` alone,
``dp=2,cp=2`` and ``cp=2,tp=2``, against one process from the same seed on the same batches
(``shardwise verify --script``'s engine, SGD with momentum, fp32, ragged -100 masks). A pair whose
plan the model cannot run (context parallel with eager attention, expert parallel on a dense
model) is checked on ``meta`` before any process starts and recorded as refused with its one line:
that refusal is the expected behaviour, not a failure.

Prints one line per pair and writes bench/results/hf_wrapped_matrix.json (pairs of earlier runs
not run now are kept).

Run:  .venv/bin/python bench/hf_wrapped_matrix.py [--steps 4] [--families llama,phi3] [--attention sdpa,eager]
      [--worlds 2,4]

``--auto`` instead trains each wrapped family with ``Trainer(plan="auto")`` on 2 processes (the
``cpu`` preset, certification on) and writes bench/results/hf_wrapped_auto.json: the plan chosen,
the certificate's verdict and the shrunken copy it compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from hf_parity_matrix import PLANS as BASE  # noqa: E402

PLANS = {2: BASE[2] + ["cp=2", "ep=2"], 4: BASE[4] + ["dp=2,cp=2", "cp=2,tp=2"]}


def script_for(family: str, attention: str, directory: str) -> str:
    """A copy of the wrapped example with the family and attention fixed."""
    with open(os.path.join(ROOT, "examples", "hf_wrapped_script.py")) as fh:
        text = (fh.read().replace('os.environ.get("SHARDWISE_HF_FAMILY", "llama")', repr(family))
                .replace('os.environ.get("SHARDWISE_HF_ATTENTION", "sdpa")', repr(attention)))
    path = os.path.join(directory, f"wrapped_{family}_{attention}.py")
    with open(path, "w") as fh:
        fh.write(text)
    return path


def refusal(path: str, plan: str) -> str | None:
    """The one line a plan is refused with before launch (on meta), or None."""
    import torch

    from shardwise.errors import ConfigError
    from shardwise.layout import Plan
    from shardwise.parallel.parallelize import validate
    from shardwise.verify.parity import ScriptWorkload

    try:
        with torch.device("meta"):
            validate(ScriptWorkload(path).build(0), Plan.parse(plan))
    except ConfigError as err:
        return str(err)
    return None


def auto_worker(path: str, steps: int) -> dict:
    """``Trainer(plan="auto")`` on the wrapped model of ``path`` (planned with the ``cpu`` preset,
    certified by parity on a shrunken copy), on this pool's processes."""
    import runpy

    import torch
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    from shardwise.train import LoggingOptions, ParallelOptions, TrainOptions, Trainer
    from shardwise.auto.certify import CertifyOptions

    ns = runpy.run_path(path, run_name="wrapped")
    model = ns["build_model"](0)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, ns["CONFIG"].vocab_size, (64, ns["SEQ"] + 1), generator=gen)
    with tempfile.TemporaryDirectory() as run_dir:
        run_dir = [run_dir]
        dist.broadcast_object_list(run_dir, src=0)
        trainer = Trainer(model, loss_fn=ns["loss_fn"], plan="auto", global_batch_size=8,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.05), train=TrainOptions(max_steps=steps),
                          parallel=ParallelOptions(cluster="cpu", certify=CertifyOptions(enabled=True)),
                          logging=LoggingOptions(progress_bar=False, run_dir=run_dir[0]))
        result = trainer.fit(TensorDataset(tokens[:, :-1], tokens[:, 1:]))
        dist.barrier()
        saved = json.load(open(os.path.join(run_dir[0], "auto_plan.json"))) if dist.get_rank() == 0 else {}
        dist.barrier()
    cert = saved.get("certificate", {})
    return {"plan": str(trainer.plan), "loss": result.train_loss, "certified": cert.get("certified"),
            "candidates": [(c.get("plan"), c.get("passed")) for c in cert.get("candidates", [])],
            "model": cert.get("compared", {}).get("model")}


def main() -> int:
    from shardwise.models.hf import FAMILIES
    from shardwise.testing import WorkerPool
    from shardwise.verify.parity import Run, ScriptWorkload, Training, parity_worker

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--attention", default="sdpa,eager")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument(
        "--auto", action="store_true", help="instead: Trainer(plan='auto') on each wrapped family, 2 processes"
    )
    args = parser.parse_args()
    if args.auto:
        return auto_main(args)
    out = os.path.join(ROOT, "bench", "results", "hf_wrapped_matrix.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    rows: list[dict] = []

    def save() -> None:
        kept = []
        if os.path.exists(out):  # the pairs of other runs (families, attentions or worlds not run now)
            with open(out) as fh:
                done = {(r["family"], r["attention"], r["plan"]) for r in rows}
                kept = [r for r in json.load(fh)["rows"] if (r["family"], r["attention"], r["plan"]) not in done]
        every = kept + rows
        ran = [r for r in every if not r.get("refused")]
        with open(out, "w") as fh:
            json.dump(
                {
                    "steps": args.steps,
                    "wrapper": "forward(ids) -> self.model(ids).logits (examples/hf_wrapped_script.py)",
                    "passed": sum(r["passed"] for r in ran),
                    "ran": len(ran),
                    "refused": len(every) - len(ran),
                    "rows": every,
                },
                fh,
                indent=2,
            )

    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.worlds.split(",")):
            pool = WorkerPool(world, timeout_s=1800)
            try:
                for family in args.families.split(","):
                    for attention in args.attention.split(","):
                        path = script_for(family, attention, tmp)
                        plans, start = [], time.perf_counter()
                        for plan in PLANS[world]:
                            why = refusal(path, plan)
                            if why is None:
                                plans.append(plan)
                            else:
                                rows.append({"family": family, "attention": attention, "plan": plan, "world": world,
                                             "refused": why, "passed": None})
                                print(f"{family:8s} {attention:5s} {plan:34s} refused before launch: {why}", flush=True)
                        if plans:
                            reports = pool.run(
                                parity_worker, ScriptWorkload(path), [Run(p) for p in plans], Training(steps=args.steps)
                            )[0]
                            for plan, report in zip(plans, reports):
                                name, wdiff = report.weight_diff
                                row = {
                                    "family": family,
                                    "attention": attention,
                                    "plan": plan,
                                    "world": world,
                                    "loss": report.loss_diff,
                                    "grad_norm": report.grad_norm_diff,
                                    "weights": wdiff,
                                    "worst_weight": name,
                                    "passed": report.passed(1e-5),
                                }
                                rows.append(row)
                                print(
                                    f"{family:8s} {attention:5s} {plan:34s} loss {row['loss']:.1e}  grad norm "
                                    f"{row['grad_norm']:.1e}  weights {wdiff:.1e}  "
                                    f"{'PASS' if row['passed'] else 'FAIL'}",
                                    flush=True,
                                )
                        print(
                            f"  ({family}/{attention} on {world} processes: {time.perf_counter() - start:.0f} s)",
                            flush=True,
                        )
                        save()
            finally:
                pool.close()
    save()
    return 0 if all(r["passed"] is not False for r in rows) else 1


def auto_main(args: argparse.Namespace) -> int:
    """``--auto``: bench/results/hf_wrapped_auto.json, one row per (family, attention)."""
    from shardwise.testing import WorkerPool

    rows = []
    out = os.path.join(ROOT, "bench", "results", "hf_wrapped_auto.json")
    with tempfile.TemporaryDirectory() as tmp:
        pool = WorkerPool(2, timeout_s=1800)
        try:
            for family in args.families.split(","):
                for attention in args.attention.split(","):
                    start = time.perf_counter()
                    try:
                        got = pool.run(auto_worker, script_for(family, attention, tmp), args.steps)[0]
                        row = {"family": family, "attention": attention, **got, "trained": got["loss"] == got["loss"],
                               "seconds": round(time.perf_counter() - start, 1)}
                    except Exception as exc:  # noqa: BLE001 - recorded, the next family still runs
                        row = {
                            "family": family,
                            "attention": attention,
                            "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                            "trained": False,
                        }
                    rows.append(row)
                    print(f"{family:8s} {attention:5s} {row.get('plan', '-'):24s} certified {row.get('certified')}  "
                          f"{row.get('error', '')}", flush=True)
                    kept = []
                    if os.path.exists(out):  # the rows of other (family, attention) pairs run before
                        with open(out) as fh:
                            done = {(r["family"], r["attention"]) for r in rows}
                            kept = [r for r in json.load(fh)["rows"] if (r["family"], r["attention"]) not in done]
                    with open(out, "w") as fh:
                        json.dump(
                            {"steps": args.steps, "world": 2, "cluster": "cpu preset", "rows": kept + rows},
                            fh,
                            indent=2,
                        )
        finally:
            pool.close()
    return 0 if all(r["trained"] and r.get("certified") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
