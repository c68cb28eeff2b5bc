"""Time to the first step of a 2-process Hugging Face fine-tune: ``shardwise train --model.hf``
against ``torchrun`` of a hand-written script doing the same (gloo, DDP, AdamW, the same tiny Llama
and batch), on this machine's CPU; and ``shardwise train --model.hf`` with its workers forked from a
fork server that imported torch, shardwise and transformers once (``SHARDWISE_FORKSERVER``,
:mod:`shardwise.launch.forkserver`).

Each is started ``--repeats`` times, alternating; the figure is the wall time from the launch to the
line that reports step 1, and the CPU-seconds (user + system) of the whole run (every process; for
the forked workers, the server's waited-for children over the run). Writes
``bench/results/startup_hf.json``.

    python bench/startup_hf.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HAND_WRITTEN = '''
import os, sys, time
import torch, torch.distributed as dist
import transformers
dist.init_process_group("gloo")
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
ids = torch.randint(0, model.config.vocab_size, (2, 17))
loss = ddp(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
loss.backward()
opt.step()
if dist.get_rank() == 0:
    print(f"step 1 loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
'''


def _server_cpu(pid: int | None) -> float:
    """CPU-seconds of the fork server's waited-for children (its workers), 0 without one."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def _first_step(argv: list[str], marker: str, cwd: str, env: dict[str, str],
                server: int | None) -> tuple[float, float]:
    """(seconds to the line holding ``marker``, CPU-seconds of the whole run)."""
    before, served = resource.getrusage(resource.RUSAGE_CHILDREN), _server_cpu(server)
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    seen, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if seen is None and marker in line:
            seen = time.monotonic() - start
    if proc.wait() != 0 or seen is None:
        raise SystemExit(f"{' '.join(argv)} failed:\n{''.join(lines[-30:])}")
    time.sleep(0.2)  # the server reaps its last worker
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return seen, cpu + _server_cpu(server) - served


def _start_server(work: str) -> subprocess.Popen:
    from shardwise.launch.forkserver import PRELOAD

    path = os.path.join(work, "fs.sock")
    server = subprocess.Popen([sys.executable, "-m", "shardwise.launch.forkserver", "--socket", path, "--preload",
                               ",".join((*PRELOAD, "shardwise.jobs.hf_train", "transformers"))],
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    while not os.path.exists(path):
        time.sleep(0.1)
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from shardwise.models import hf

    work = tempfile.mkdtemp(prefix="startup-hf-")
    texts = [open(os.path.join(os.path.dirname(os.__file__), "json", n)).read() for n in ("decoder.py", "encoder.py")]
    hf.save_tiny(os.path.join(work, "model"), family="llama", texts=texts, vocab=320, seq=64)
    with open(os.path.join(work, "data.txt"), "w") as fh:
        fh.write("\n".join(texts))
    with open(os.path.join(work, "hand.py"), "w") as fh:
        fh.write(HAND_WRITTEN)
    runs = {
        "shardwise train --model.hf": (
            [
                sys.executable,
                "-m",
                "shardwise.cli",
                "train",
                "--nproc",
                "2",
                "--model.hf",
                "model",
                "--data.files",
                "data.txt",
                "--max-steps",
                "1",
                "--model.seq_len",
                "16",
                "--train.global_batch_size",
                "2",
                "--train.warmup_steps",
                "1",
                "--train.eval_every",
                "0",
                "--train.log_every",
                "1",
                "--checkpoint.every_n_steps",
                "0",
            ],
            "step 1/",
        ),
        "torchrun hand-written": (
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "hand.py", "model"],
            "step 1 loss",
        ),
    }
    runs["shardwise train --model.hf, fork server"] = runs["shardwise train --model.hf"]
    server = _start_server(work)
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for i in range(args.repeats):
        for name, (argv, marker) in runs.items():
            forked = name.endswith("fork server")
            env = {k: v for k, v in os.environ.items() if k != "SHARDWISE_FORKSERVER"}
            if forked:
                env["SHARDWISE_FORKSERVER"] = os.path.join(work, "fs.sock")
            argv = [*argv, "--run.name", f"r{i}{forked:d}"] if name.startswith("shardwise") else argv
            figures[name].append(_first_step(argv, marker, work, env, server.pid if forked else None))
    server.terminate()
    server.wait()
    print(
        f"time to the first step, 2 processes, best of {args.repeats} (load {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores):"
    )
    for name, got in figures.items():
        print(f"  {name:40s} {min(s for s, _ in got):6.1f} s   {min(c for _, c in got):6.1f} CPU-s")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "startup_hf.json")
    with open(out, "w") as fh:
        json.dump({"repeats": args.repeats, "load": os.getloadavg()[0], "cores": os.cpu_count(),
                   "runs": {name: {"wall_s": [s for s, _ in got], "cpu_s": [c for _, c in got]}
                            for name, got in figures.items()}}, fh, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
