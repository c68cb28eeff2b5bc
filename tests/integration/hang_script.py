"""A small training loop that ``shardwise run`` starts in the hang tests, with one injected fault.

    python hang_script.py MODE RANK [STEPS]

MODE ``skip``: RANK does not call the gradient all-reduce of step 3 (a collective issued on some
ranks only); ``stop``: RANK sends itself SIGSTOP at step 3 (a frozen process); ``none``: no fault.
The watchdog is started by ``shardwise.init()`` and reads ``SHARDWISE_HANG_TIMEOUT``.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

import shardwise
from shardwise.runtime.watchdog import current


def main() -> None:
    mode, target = sys.argv[1], int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    env = shardwise.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        loss = model(torch.randn(8, 16)).square().mean()
        opt.zero_grad()
        loss.backward()
        if mode == "stop" and env.rank == target and step == 3:
            print(f"rank {env.rank}: stopping myself (SIGSTOP) at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        if mode == "skip" and env.rank == target and step == 3:
            print(f"rank {env.rank}: skipping the all_reduce of step {step}", flush=True)
        else:
            dist.all_reduce(flat)
        opt.step()
        if current() is not None:
            current().step(step)
    print(f"rank {env.rank}: finished {steps} steps", flush=True)
    shardwise.shutdown()


if __name__ == "__main__":
    main()
