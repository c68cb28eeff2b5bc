"""Sharded generation: ``tp=2`` produces the same tokens as one process, greedy and sampled (same
seed), from a local Hugging Face directory (a tiny Llama with its own BPE tokenizer, made here)
and from a shardwise checkpoint of that model trained 2 steps under ``pp=2``; the KV cache gives
the tokens of full recomputation; the checkpoint's tokens equal those of its Hugging Face export;
and ``shardwise generate`` prints what the workers return."""

from __future__ import annotations

import glob
import os
import subprocess

import pytest
import torch
from torch.utils.data import TensorDataset

from shardwise.commands.generate import generate_worker
from shardwise.errors import ConfigError
from shardwise.generate.decode import Sampling
from tests.worker_forkserver import python

PROMPT = "def main():"
GREEDY = Sampling(max_new_tokens=10)
SAMPLED = Sampling(max_new_tokens=10, temperature=1.0, top_k=20, seed=3)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from shardwise.models.hf import save_tiny

    directory = str(tmp_path_factory.mktemp("tiny-llama"))
    texts = [
        open(f).read()[:3000] for f in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "json", "*.py")))
    ]
    save_tiny(directory, family="llama", texts=texts, vocab=128, hidden=32, heads=4, kv_heads=2, layers=2, seq=64)
    return directory


def train_checkpoint(hf: str, directory: str) -> int:
    """2 SGD steps of the Hugging Face model under pp=2, checkpointed with its config and tokenizer."""
    from shardwise.checkpoint import CheckpointManager
    from shardwise.checkpoint.hf_load import Pretrained
    from shardwise.jobs.hf_train import KeepModelFiles
    from shardwise.models.hf import lm_loss
    from shardwise.train import LoggingOptions, TrainOptions, Trainer

    tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(Pretrained(hf), loss_fn=lm_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), plan="pp=2",
                      global_batch_size=4, train=TrainOptions(max_steps=2, seed=0),
                      logging=LoggingOptions(progress_bar=False), callbacks=[KeepModelFiles(hf, directory)],
                      checkpoint=CheckpointManager(directory))
    trainer.fit(TensorDataset(tokens[:, :-1], tokens[:, 1:]))
    return trainer.step


def _gen(source: str, plan: str, sampling: Sampling, model_dir: str | None = None) -> list[int]:
    return generate_worker(source, plan, PROMPT, None, sampling, model_dir, None)["ids"]


def test_tp2_generates_the_tokens_of_one_process(pools, hf_dir, tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    assert pools(2).run(train_checkpoint, hf_dir, ckpt) == [2, 2]
    for source in (hf_dir, ckpt):
        for sampling in (GREEDY, SAMPLED):
            one = pools(1).run(_gen, source, "tp=1", sampling)[0]
            assert len(one) > 10 and one[:3] != one[-3:]
            assert pools(2).run(_gen, source, "tp=2", sampling) == [one, one], (source, sampling)
    # the KV cache changes nothing but the cost; the checkpoint holds the trained weights
    from dataclasses import replace

    from shardwise.checkpoint.hf_export import export_hf

    one = pools(1).run(_gen, ckpt, "tp=1", GREEDY)[0]
    assert pools(1).run(_gen, ckpt, "tp=1", replace(GREEDY, use_cache=False))[0] == one
    export_hf(ckpt, str(tmp_path / "exported"))
    assert pools(1).run(_gen, str(tmp_path / "exported"), "tp=1", GREEDY)[0] == one

    cli = subprocess.run(
        python(
            "-m",
            "shardwise",
            "generate",
            "--checkpoint",
            ckpt,
            "--prompt",
            PROMPT,
            "--plan",
            "tp=2",
            "--max-new-tokens",
            "10",
            "--ids",
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert f"ids: {','.join(map(str, one))}" in cli.stdout


def test_generate_refuses_a_pipeline_and_a_checkpoint_without_config(tmp_path) -> None:
    run = python("-m", "shardwise", "generate", "--checkpoint", str(tmp_path), "--prompt", "x")
    out = subprocess.run(run + ["--plan", "pp=2"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "does not run under pipeline parallelism" in out.stderr, out.stderr
    (tmp_path / "step_00000001").mkdir()
    with pytest.raises(ConfigError, match="keeps no model config"):
        from shardwise.generate.decode import model_files

        model_files(str(tmp_path))
