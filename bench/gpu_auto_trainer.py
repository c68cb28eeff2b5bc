"""Trainer(plan="auto") on one GPU: the first run measures the GPU (plan.machine), a second reads the
cache; prints the chosen plan, its prediction and the measured step time. Run on a CUDA machine:

    SHARDWISE_CACHE_DIR=/tmp/cache python bench/gpu_auto_trainer.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))


def main() -> int:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.train import LoggingOptions, TrainOptions, Trainer

    cfg = GPTConfig(vocab_size=32768, seq_len=1024, layers=8, hidden=1024, heads=16)
    ids = torch.randint(0, cfg.vocab_size, (8 * 12, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(ids[:, :-1], ids[:, 1:])

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float().flatten(0, 1), target.flatten(0, 1))

    out = {}
    for attempt in ("first", "cached"):
        start = time.perf_counter()
        trainer = Trainer(GPT(cfg, seed=0), loss_fn=loss_fn, global_batch_size=8, plan="auto", precision="bf16",
                          optimizer=lambda p: torch.optim.Adam(p, lr=1e-4), train=TrainOptions(max_steps=12),
                          logging=LoggingOptions(log_every=1, progress_bar=False))
        trainer.setup(data)  # plan="auto" is chosen from the data
        planned_s = time.perf_counter() - start
        result = trainer.fit(data)
        times = [row["step_time_s"] for row in result.history if "step_time_s" in row][4:]
        choice = trainer.auto_choice
        out[attempt] = {"plan": str(trainer.plan), "planning_s": planned_s, "measured_step_s": statistics.median(times),
                        "predicted_step_s": choice.estimate.step_time_s if choice else None}
        print(
            f"{attempt}: plan {trainer.plan}, planning {planned_s:.1f} s, step "
            f"{1e3 * out[attempt]['measured_step_s']:.1f} ms (predicted "
            f"{1e3 * (out[attempt]['predicted_step_s'] or 0):.1f} ms)",
            flush=True,
        )
    print("cache:", os.listdir(os.environ.get("SHARDWISE_CACHE_DIR", ".")))
    print("RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
