"""``shardwise train --model.hf DIR --data.files ...`` end to end: a tiny Llama-style model and its
BPE tokenizer made locally, fine-tuned on local text and JSONL files on 2 processes with
``--plan auto`` (the planner reads the shape from ``config.json``; the ``cpu`` cluster preset keeps
the machine from being measured); a run killed after its step-2 checkpoint and continued with
``--resume auto`` reproduces an uninterrupted run exactly (losses and final weights, compared
through ``shardwise checkpoint export --format hf``); the same with the text read as a stream
and a validation file (three more runs). Runs of ~20 s each. The commands fork from one process
that imported torch, shardwise and transformers once (:func:`tests.forkrun.shardwise_command`:
what the subprocess returns, without the seconds of imports per command); their workers start as
usual.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sysconfig

import pytest

pytest.importorskip("transformers")

from shardwise.models import hf  # noqa: E402
from tests.forkrun import Zygote, ZygoteDir, shardwise_command  # noqa: E402


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, hf_zygote: Zygote) -> ZygoteDir:
    root = tmp_path_factory.mktemp("hf-cli")
    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in sorted(os.listdir(os.path.join(stdlib, "json"))):
        if name.endswith(".py"):
            with open(os.path.join(stdlib, "json", name)) as fh:
                texts.append(fh.read())
    hf.save_tiny(str(root / "model"), family="llama", texts=texts, vocab=320, seq=32)
    data = root / "data" / "nested"
    data.mkdir(parents=True)
    for i, text in enumerate(texts[:3]):
        (data / f"part{i}.txt").write_text(text)
    with open(root / "data" / "more.jsonl", "w") as fh:
        for text in texts[3:]:
            fh.write(json.dumps({"text": text}) + "\n")
    return ZygoteDir.of(root, hf_zygote)


def _train(
    workdir: ZygoteDir, name: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    args = [
        "train",
        "--model.hf",
        os.path.join(workdir, "model"),
        "--data.files",
        f"{workdir}/data/**/*.txt,{workdir}/data/*.jsonl",
        "--nproc",
        "2",
        "--plan",
        "auto",
        "--max-steps",
        "4",
        "--train.global_batch_size=4",
        "--train.warmup_steps=2",
        "--train.eval_every=0",
        "--train.log_every=1",
        "--checkpoint.every_n_steps=2",
        "--run.runs_dir",
        os.path.join(workdir, "runs"),
        "--run.name",
        name,
        *extra,
    ]
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "SHARDWISE_CLUSTER": "cpu",
        **(env or {}),
    }
    return shardwise_command(workdir.zygote, args, env=full_env, timeout=300)


def _losses(workdir: str, name: str) -> dict[int, str]:
    with open(os.path.join(workdir, "runs", name, "metrics.csv")) as fh:
        return {int(row["step"]): row["loss"] for row in csv.DictReader(fh) if row.get("loss")}


def _export(workdir: ZygoteDir, name: str) -> dict:
    from safetensors.torch import load_file

    out = os.path.join(workdir, f"export-{name}")
    done = shardwise_command(
        workdir.zygote,
        ["checkpoint", "export", "--format", "hf", os.path.join(workdir, "runs", name, "checkpoints"), out],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(out))  # kept from the model directory by the run
    return load_file(os.path.join(out, "model.safetensors"))


def test_finetune_plan_auto_and_exact_resume(workdir: ZygoteDir) -> None:
    full = _train(workdir, "full")
    assert full.returncode == 0, full.stdout + full.stderr
    assert "plan=auto chose" in full.stdout and "nats/token" in full.stdout and "4 file(s)" in full.stdout, full.stdout
    killed = _train(workdir, "resumed", env={"SHARDWISE_FAULT": "rank=0,step=3,how=raise"})
    assert killed.returncode != 0
    resumed = _train(workdir, "resumed", "--resume", "auto")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    want, got = _losses(workdir, "full"), _losses(workdir, "resumed")
    assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]
    summary = json.loads(open(os.path.join(workdir, "runs", "resumed", "summary.json")).read())
    assert summary["steps"] == 4 and summary["unit"] == "token"
    a, b = _export(workdir, "full"), _export(workdir, "resumed")
    assert set(a) == set(b)
    assert all(a[k].equal(b[k]) for k in a)


def test_finetune_streaming_with_validation_files_resumes_exactly(workdir: ZygoteDir) -> None:
    """``--data.streaming true``: the text files are read as a packed stream (file order and a
    shuffle buffer reshuffled per epoch), the JSONL file is the validation split, ``--plan auto``
    sizes the model from the stream; a run killed at step 3 and resumed from its step-2 checkpoint
    trains on exactly the uninterrupted run's windows (the same losses, bitwise)."""
    stream = (
        "--data.streaming",
        "true",
        "--data.files",
        f"{workdir}/data/**/*.txt",
        "--data.val_files",
        f"{workdir}/data/*.jsonl",
        "--data.shuffle_windows",
        "8",
        "--train.eval_every=2",
    )
    full = _train(workdir, "stream-full", *stream)
    assert full.returncode == 0, full.stdout + full.stderr
    assert "3 file(s) streamed; validation 1 file(s)" in full.stdout and "nats/token" in full.stdout, full.stdout
    killed = _train(workdir, "stream-cut", *stream, env={"SHARDWISE_FAULT": "rank=0,step=3,how=raise"})
    assert killed.returncode != 0
    resumed = _train(workdir, "stream-cut", *stream, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    want, got = _losses(workdir, "stream-full"), _losses(workdir, "stream-cut")
    assert sorted(want) == [1, 2, 3, 4] and [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]
    summaries = [
        json.loads(open(os.path.join(workdir, "runs", n, "summary.json")).read()) for n in ("stream-full", "stream-cut")
    ]
    assert summaries[0]["val_loss"] == summaries[1]["val_loss"] and summaries[0]["unigram_entropy"] > 0
