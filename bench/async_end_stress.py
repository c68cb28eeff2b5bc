"""Many short ``shardwise train`` runs whose last step is a scheduled async save: do any hang?

The configuration of the issue that found the race (2 processes, 12 steps, an async save every 3,
so the last step is also a save). Each run is a separate process tree with the hang watchdog at
``--hang-timeout`` seconds and a hard timeout around it; a hang shows as exit code 1 with a
``HANG`` verdict, or as the hard timeout. Prints one line per run and the totals.

    python bench/async_end_stress.py [--runs 20] [--hang-timeout 30] [--out bench/results/async_end_stress.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ARGS = ["--nproc", "2", "--max-steps", "12", "--checkpoint.every_n_steps=3", "--checkpoint.async_save=true",
        "--model.layers=1", "--model.hidden=32", "--model.heads=2", "--model.seq_len=32", "--data.max_chars=20000",
        "--train.global_batch_size=8", "--sample.chars=0"]


def one_run(cwd: str, index: int, hang_timeout: float) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "shardwise",
        "train",
        f"--run.name=s{index}",
        *ARGS,
        "--hang-timeout",
        f"{hang_timeout:g}",
    ]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=hang_timeout + 300,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, output = None, str(err.stdout or "") + str(err.stderr or "")
    ckpts = os.path.join(cwd, "runs", f"s{index}", "checkpoints")
    steps = sorted(int(n[5:]) for n in os.listdir(ckpts) if n.startswith("step_")) if os.path.isdir(ckpts) else []
    return {
        "run": index,
        "rc": rc,
        "hang": rc is None or "HANG" in output,
        "wall_s": round(time.monotonic() - start, 1),
        "checkpoints": steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--hang-timeout", type=float, default=30.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="async-end-") as cwd:
        for i in range(1, args.runs + 1):
            r = one_run(cwd, i, args.hang_timeout)
            results.append(r)
            print(
                f"run {r['run']:2d}: exit {r['rc']}, hang {r['hang']}, {r['wall_s']} s, checkpoints {r['checkpoints']}",
                flush=True,
            )
    ok = sum(r["rc"] == 0 and not r["hang"] for r in results)
    hangs = sum(r["hang"] for r in results)
    print(f"{ok} of {len(results)} runs ended normally, {hangs} hung")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"runs": results, "ok": ok, "hangs": hangs}, fh, indent=1)


if __name__ == "__main__":
    main()
