"""Generation from a checkpoint of the built-in GPT job: a real ``shardwise train`` run (one
process, 2 steps, a 2-layer model) keeps the model's shape and characters beside its checkpoints;
from those alone the model is rebuilt on meta and loaded with each rank's slices. Its loss on the
run's validation windows is the one the run reported (the trained weights, not a fresh model);
under ``tp=2`` the greedy and the sampled tokens (same seed) equal one process's, and the greedy
ones under ``dp=2`` and ``zero=3``; the KV cache gives the tokens of full recomputation; and
``shardwise generate`` prints them."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace

import pytest
import torch

from shardwise.commands.generate import generate_worker
from shardwise.generate.decode import Sampling
from tests.worker_forkserver import python

PROMPT = "def "
GREEDY = Sampling(max_new_tokens=12)
SAMPLED = Sampling(max_new_tokens=12, temperature=1.0, top_k=20, seed=3)
TRAIN = ["--nproc", "1", "--run.name=g", "--max-steps", "2", "--model.layers=2", "--model.hidden=32", "--model.heads=2",
         "--model.seq_len=32", "--data.max_chars=20000", "--train.global_batch_size=4", "--train.eval_every=0",
         "--train.eval_windows=4", "--sample.chars=0"]


def _shardwise(args: list[str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MPLCONFIGDIR": os.path.join(cwd, ".mpl")}
    return subprocess.run(
        python("-m", "shardwise", *args, env=env), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    cwd = str(tmp_path_factory.mktemp("gpt-run"))
    out = _shardwise(["train", *TRAIN], cwd, timeout=240)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return os.path.join(cwd, "runs", "g")


def _gen(source: str, plan: str, sampling: Sampling) -> list[int]:
    return generate_worker(source, plan, PROMPT, None, sampling, None, None)["ids"]


def validation_loss(source: str) -> float:
    """The loaded model's mean loss on the run's validation windows (the first 4, as the run's)."""
    from shardwise.data.corpus import CharWindows, load_stdlib_corpus
    from shardwise.jobs.train import lm_loss
    from shardwise.resolve import resolve_plan
    from shardwise.parallel.mesh import build_mesh
    from shardwise.generate.decode import load_model

    plan = resolve_plan("tp=1", 1)
    lm = load_model(source, plan, build_mesh(plan, "cpu"), device=torch.device("cpu"))
    windows = CharWindows(load_stdlib_corpus(max_chars=20000).val, 32)
    inputs = torch.stack([windows[i][0] for i in range(4)])
    targets = torch.stack([windows[i][1] for i in range(4)])
    with torch.no_grad():
        return float(lm_loss(lm.module.eval()(inputs), targets))


def test_tp2_dp2_zero3_decode_the_tokens_of_one_process(pools, run_dir) -> None:
    ckpt = os.path.join(run_dir, "checkpoints")
    assert sorted(os.listdir(ckpt)) == ["gpt", "latest", "step_00000002"]
    reported = json.loads(open(os.path.join(run_dir, "summary.json")).read())["val_loss"]
    assert pools(1).run(validation_loss, ckpt)[0] == pytest.approx(reported, rel=1e-5)
    tokens = {}
    for sampling in (GREEDY, SAMPLED):
        one = tokens[sampling] = pools(1).run(_gen, ckpt, "tp=1", sampling)[0]
        assert len(one) == len(PROMPT) + 12 and len(set(one[len(PROMPT):])) > 3
        assert pools(1).run(_gen, ckpt, "tp=1", replace(sampling, use_cache=False))[0] == one, sampling
        assert pools(2).run(_gen, ckpt, "tp=2", sampling) == [one, one], sampling
        if sampling is GREEDY:
            assert pools(2).run(_gen, ckpt, "dp=2", sampling) == [one, one]
            assert pools(2).run(_gen, ckpt, "zero=3,dp=2", sampling) == [one, one]

    cli = _shardwise(
        ["generate", "--checkpoint", ckpt, "--prompt", PROMPT, "--max-new-tokens", "12", "--ids"], run_dir, timeout=180
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert f"ids: {','.join(map(str, tokens[GREEDY]))}" in cli.stdout
    assert cli.stdout.startswith(PROMPT)
