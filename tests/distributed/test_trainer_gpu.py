"""The Trainer on one CUDA device (skipped without one): bf16 and fp16 train, fp16 scales the loss,
pinned-memory loading works, and MFU is reported when the GPU's peak FLOP/s is known."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import json, sys, warnings
import torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
from tests.helpers import Record, make_data, make_model, sgd
from shardwise.train import Trainer
out = {}
for precision in ("bf16", "fp16"):
    rec = Record()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = Trainer(make_model(), loss_fn=F.cross_entropy, optimizer=sgd, precision=precision, global_batch_size=32,
                    train=TrainOptions(max_steps=20), data=DataOptions(pin_memory=True),
                    logging=LoggingOptions(log_every=1, flops_per_sample=1e6, progress_bar=False), callbacks=[rec])
    result = t.fit(make_data())
    out[precision] = {"losses": rec.losses, "device": str(t.env.device), "mfu": t.history[-1].get("mfu"),
                      "scale": t.scaler.scale if t.scaler else None,
                      "cpu_warning": any("CPU" in str(w.message) for w in caught)}
out["name"] = torch.cuda.get_device_name(0)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trainer_on_one_gpu_in_bf16_and_fp16() -> None:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, repo], capture_output=True, text=True, timeout=300, env=env, cwd=repo
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    for precision in ("bf16", "fp16"):
        res = out[precision]
        assert res["device"].startswith("cuda") and not res["cpu_warning"]
        assert res["losses"][-1] < 0.7 * res["losses"][0]
    assert out["fp16"]["scale"] is not None and out["fp16"]["scale"] > 1.0
    if any(gpu in out["name"].upper() for gpu in ("H100", "H200", "A100")):
        assert 0 < out["bf16"]["mfu"] < 1
