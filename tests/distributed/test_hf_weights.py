"""Hugging Face weights in and out, on real Gloo processes (tiny models saved with save_pretrained).

- loading (``shardwise.from_pretrained``) gives the logits transformers' own ``from_pretrained``
  gives, under DDP, ZeRO-3, TP and PP, while each rank reads and holds about 1/N of the model
  (counted element by element: under ZeRO-3 and TP no rank materializes the full model);
- the round trip: from_pretrained into ``tp=2,pp=2`` on 4 processes, a few SGD steps, a sharded
  save, ``shardwise checkpoint export --format hf``, and transformers' ``from_pretrained`` of the
  export gives the trained sharded model's logits.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

pytest.importorskip("transformers")

from shardwise.models import hf  # noqa: E402
from tests.worker_forkserver import python

SEQ = 16


def _ids(step: int, batch: int = 4) -> torch.Tensor:
    return torch.randint(0, 64, (batch, SEQ + 1), generator=torch.Generator().manual_seed(500 + step))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One tiny checkpoint directory per family used here (a tokenizer is not needed)."""
    out = {}
    for family in ("llama", "gpt2", "mixtral"):
        path = str(tmp_path_factory.mktemp(f"hf-{family}"))
        hf.build_causal_lm(hf.tiny_config(family), seed=1).save_pretrained(path)
        out[family] = path
    return out


def load_worker(path: str, plan: str) -> tuple[float, int, int, int, int]:
    """(max |logits - transformers' logits| or loss difference under PP, read, local, total, whole reads)."""
    import transformers
    from torch.distributed.tensor import DTensor

    from shardwise.train.pretrained import from_pretrained

    pm = from_pretrained(path, plan=plan, loss_fn=hf.lm_loss)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    ids = _ids(0)
    with torch.no_grad():
        want = ref(ids[:, :-1]).logits
        if pm.pipeline is None:
            got = hf.logits_of(pm.module(ids[:, :-1]))
            got = got.full_tensor() if isinstance(got, DTensor) else got
            diff = float((got - want).abs().max())
        else:
            loss, logits = pm.pipeline.eval_outputs(ids[:, :-1], ids[:, 1:])
            diff = (
                float((logits - want).abs().max())
                if logits is not None
                else abs(float(loss) - float(hf.lm_loss(want, ids[:, 1:])))
            )
    s = pm.load
    return diff, s.elements_read, s.elements_local, s.elements_total, s.whole_reads


@pytest.mark.parametrize(
    "family,plan",
    [
        ("llama", "zero=3,shard=2"),
        ("llama", "tp=2"),
        ("gpt2", "tp=2"),
        ("mixtral", "tp=2"),
        ("gpt2", "pp=2,microbatches=2"),
        ("mixtral", "dp=2"),
    ],
)
def test_from_pretrained_reads_only_its_slices(dist2, saved: dict[str, str], family: str, plan: str) -> None:
    results = dist2.run(load_worker, saved[family], plan)
    for diff, read, local, total, whole in results:
        assert diff < 1e-5, (family, plan, diff)
        assert whole == 0
        if plan == "dp=2":  # DDP holds the model on every rank
            assert read == local == total
        else:  # each rank reads and keeps about half (replicated norms and biases make it a bit more)
            assert read == local and local <= 0.56 * total, (family, plan, local / total)


def roundtrip_worker(path: str, ckpt: str) -> tuple[torch.Tensor | None, float, float]:
    """Load into tp=2,pp=2, train 3 SGD steps, save; return the last stage's logits, the loss and this
    rank's read fraction."""
    from shardwise.checkpoint import CheckpointManager
    from shardwise.train.pretrained import from_pretrained

    pm = from_pretrained(path, plan="tp=2,pp=2,microbatches=2", loss_fn=hf.lm_loss)
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    for step in range(3):
        ids = _ids(step)
        pm.pipeline.step(ids[:, :-1], ids[:, 1:])
        opt.step()
        opt.zero_grad(set_to_none=True)
    CheckpointManager(ckpt, plan=pm.plan).save({"model": pm.module, "optimizer": opt}, step=3)
    ids = _ids(99)
    loss, logits = pm.pipeline.eval_outputs(ids[:, :-1], ids[:, 1:])
    return logits, float(loss), pm.load.fraction_read


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_roundtrip_tp2_pp2_export_loads_in_transformers(dist4, saved: dict[str, str], tmp_path, family: str) -> None:
    import transformers

    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "export")
    results = dist4.run(roundtrip_worker, saved[family], ckpt)
    assert all(fraction < 0.4 for _, _, fraction in results), [r[2] for r in results]  # 4 ranks: about 1/4 each
    logits = [r[0] for r in results if r[0] is not None]
    assert len(logits) == 2  # the two TP ranks of the last stage
    done = subprocess.run(
        python(
            "-m",
            "shardwise",
            "checkpoint",
            "export",
            "--format",
            "hf",
            ckpt,
            out,
            "--model",
            saved[family],
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = _ids(99)
    with torch.no_grad():
        want = exported(ids[:, :-1]).logits
    torch.testing.assert_close(logits[0], want, rtol=1e-5, atol=1e-6)
    # the weights changed: the export is the trained model, not the one loaded
    original = transformers.AutoModelForCausalLM.from_pretrained(saved[family])
    with torch.no_grad():
        assert (original(ids[:, :-1]).logits - want).abs().max() > 1e-3
