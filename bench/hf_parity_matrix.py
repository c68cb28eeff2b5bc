"""Parity of every Hugging Face family under every plan: the (model, plan) matrix behind docs/parallelism.md.

Each family of :data:`shardwise.models.hf.FAMILIES` (tiny configs from ``examples/hf_verify_script.py``:
4 layers, hidden 32, nothing downloaded) is trained under each plan and as one process from the same
seed on the same batches (``shardwise verify --script``'s engine, SGD with momentum, fp32), on 2 or 4
Gloo processes. Prints one line per pair with the largest relative divergence of the loss, the
gradient norm and the weights, and writes bench/results/hf_parity_matrix.json.

Run:  .venv/bin/python bench/hf_parity_matrix.py [--steps 10] [--families llama,gpt2] [--extra]
(--extra adds interleaved 1F1B, pp=4, ZeRO-3 x PP, DP x PP, ZeRO-3 x TP, TP x SP-free loss parallel.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANS = {2: ["dp=2", "zero=3,shard=2", "tp=2", "pp=2,microbatches=2", "pp=2,microbatches=2,schedule=1f1b"],
         4: ["dp=2,tp=2", "tp=2,pp=2,microbatches=2"]}
EXTRA = {2: ["pp=2,microbatches=4,schedule=interleaved_1f1b,virtual_stages=2"],
         4: ["pp=4,microbatches=4,schedule=1f1b", "zero=3,shard=2,pp=2,microbatches=2", "dp=2,pp=2,microbatches=2",
             "zero=3,shard=2,tp=2"]}


def script_for(family: str, directory: str) -> str:
    """A copy of the example verify script with the family fixed (worker processes are already running)."""
    with open(os.path.join(ROOT, "examples", "hf_verify_script.py")) as fh:
        text = fh.read().replace('os.environ.get("SHARDWISE_HF_FAMILY", "llama")', repr(family))
    path = os.path.join(directory, f"hf_{family}.py")
    with open(path, "w") as fh:
        fh.write(text)
    return path


def main() -> int:
    from shardwise.models.hf import FAMILIES
    from shardwise.testing import WorkerPool
    from shardwise.verify.parity import Run, ScriptWorkload, Training, parity_worker

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--extra", action="store_true")
    parser.add_argument(
        "--worlds", default="2,4", help="process counts to run (2: the 2-process plans, 4: the 4-process ones)"
    )
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (int(w) for w in args.worlds.split(",")):
            plans = PLANS[world] + (EXTRA[world] if args.extra else [])
            pool = WorkerPool(world, timeout_s=900)
            try:
                for family in args.families.split(","):
                    start = time.perf_counter()
                    reports = pool.run(parity_worker, ScriptWorkload(script_for(family, tmp)), [Run(p) for p in plans],
                                       Training(steps=args.steps))[0]
                    for plan, report in zip(plans, reports):
                        name, wdiff = report.weight_diff
                        row = {
                            "family": family,
                            "plan": plan,
                            "loss": report.loss_diff,
                            "grad_norm": report.grad_norm_diff,
                            "weights": wdiff,
                            "worst_weight": name,
                            "passed": report.passed(1e-5),
                        }
                        rows.append(row)
                        print(
                            f"{family:8s} {plan:58s} loss {row['loss']:.1e}  grad norm {row['grad_norm']:.1e}  weights "
                            f"{wdiff:.1e}  {'PASS' if row['passed'] else 'FAIL'}",
                            flush=True,
                        )
                    print(f"  ({family} on {world} processes: {time.perf_counter() - start:.0f} s)", flush=True)
            finally:
                pool.close()
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    out = os.path.join(ROOT, "bench", "results", "hf_parity_matrix.json")
    if os.path.exists(out):  # keep the pairs of other runs (families or worlds not run now)
        with open(out) as fh:
            done = {(r["family"], r["plan"]) for r in rows}
            rows = [r for r in json.load(fh)["rows"] if (r["family"], r["plan"]) not in done] + rows
    with open(out, "w") as fh:
        json.dump({"steps": args.steps, "rows": rows}, fh, indent=2)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    raise SystemExit(main())
