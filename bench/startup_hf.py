"""Time to the first step of a 2-process Hugging Face fine-tune: ``shardwise train --model.hf``
against ``torchrun`` of a hand-written script doing the same (gloo, DDP, AdamW, the same tiny Llama
and batch), on this machine's CPU.

Each is started ``--repeats`` times, alternating; the figure is the wall time from the launch to the
line that reports step 1, and the CPU-seconds (user + system) of the whole run (every process).

    python bench/startup_hf.py [--repeats 3]
"""

from __future__ import annotations

import argparse
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


def _first_step(argv: list[str], marker: str, cwd: str) -> tuple[float, float]:
    """(seconds to the line holding ``marker``, CPU-seconds of the whole run)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    seen, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if seen is None and marker in line:
            seen = time.monotonic() - start
    if proc.wait() != 0 or seen is None:
        raise SystemExit(f"{' '.join(argv)} failed:\n{''.join(lines[-30:])}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return seen, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


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
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for i in range(args.repeats):
        for name, (argv, marker) in runs.items():
            argv = [*argv, "--run.name", f"r{i}"] if name.startswith("shardwise") else argv
            figures[name].append(_first_step(argv, marker, work))
    print(
        f"time to the first step, 2 processes, best of {args.repeats} (load {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} cores):"
    )
    for name, got in figures.items():
        print(f"  {name:28s} {min(s for s, _ in got):6.1f} s   {min(c for _, c in got):6.1f} CPU-s")


if __name__ == "__main__":
    main()
