"""``shardwise train --model.hf DIR --data.format chat`` end to end on a chat JSONL written here, with
a tiny Llama and its BPE tokenizer (with a chat template) made locally:

- under ``tp=2``, padded batches, the data in memory; under ``dp=2``, packed rows, the data streamed
  (``--data.streaming true``, validation from ``--data.val_files``);
- the logged loss of step 1 covers only the assistant tokens: the global batch is all of the
  training data, so it must equal the mean over the assistant tokens of every chat, each run alone
  through the initial model, the assistant tokens found by transformers' own
  ``return_assistant_tokens_mask`` (a template with generation tags that renders the same text),
  not by shardwise's turn-by-turn rendering; for packed rows this also shows that no token
  attended across a chat boundary;
- a run killed at step 3 and continued with ``--resume auto`` from its step-2 checkpoint logs the
  uninterrupted run's losses bitwise and ends with bitwise equal weights;
- ``shardwise checkpoint export --format hf`` loads in transformers, the chat template included.

Six 2-process runs of ~15 s each (two layouts x full, killed, resumed). The commands fork from one
process that imported torch, shardwise and transformers once (:func:`tests.forkrun.shardwise_command`:
what the subprocess returns, without 3-4 CPU-seconds of imports per command); their workers start as usual.
"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shardwise.models import hf  # noqa: E402
from tests.forkrun import Zygote, ZygoteDir, shardwise_command  # noqa: E402

SEQ = 128
GEN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{{ eos_token }}\n{% endgeneration %}{% else %}{{ m['content'] }}{{ eos_token }}\n{% endif %}{% "
    "endfor %}"
)


def chats(n: int, seed: int) -> list[dict]:
    rng, out = random.Random(seed), []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        messages = [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
        ]
        if i % 3 == 0:  # ragged: some chats have a system prompt and a second exchange
            messages = [
                {"role": "system", "content": "You add numbers."},
                *messages,
                {"role": "user", "content": "And doubled?"},
                {"role": "assistant", "content": str(2 * (a + b))},
            ]
        out.append({"messages": messages})
    return out


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory, hf_zygote: Zygote) -> ZygoteDir:
    root = str(tmp_path_factory.mktemp("finetune-cli"))
    train, val = chats(17, seed=0), chats(4, seed=1)
    hf.save_tiny(
        os.path.join(root, "model"), family="llama", texts=[json.dumps(c) for c in train], vocab=320, seq=SEQ, chat=True
    )
    write_jsonl(os.path.join(root, "chat.jsonl"), train)
    write_jsonl(os.path.join(root, "val.jsonl"), val)
    return ZygoteDir.of(root, hf_zygote)


def _train(
    workdir: ZygoteDir, name: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    args = [
        "train",
        "--model.hf",
        os.path.join(workdir, "model"),
        "--data.files",
        os.path.join(workdir, "chat.jsonl"),
        "--data.format",
        "chat",
        "--nproc",
        "2",
        "--max-steps",
        "4",
        f"--model.seq_len={SEQ}",
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
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return shardwise_command(workdir.zygote, args, env=full_env, timeout=300)


def _losses(workdir: str, name: str) -> dict[int, str]:
    with open(os.path.join(workdir, "runs", name, "metrics.csv")) as fh:
        return {int(row["step"]): row["loss"] for row in csv.DictReader(fh) if row.get("loss")}


def assistant_token_loss(workdir: str, records: list[dict], *, everything: bool = False) -> float:
    """The initial model's mean loss over the assistant tokens (all tokens with ``everything``) of
    ``records``, each chat run alone."""
    import transformers

    directory = os.path.join(workdir, "model")
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    total, count = 0.0, 0
    for r in records:
        enc = tok.apply_chat_template(
            r["messages"], chat_template=GEN_TEMPLATE, return_assistant_tokens_mask=True, return_dict=True
        )
        ids, mask = torch.tensor(enc["input_ids"]), torch.tensor(enc["assistant_masks"], dtype=torch.bool)
        if everything:
            mask[:] = True
        targets = torch.where(mask[1:], ids[1:], -100)[:SEQ]
        with torch.no_grad():
            logits = model(ids[:-1][:SEQ][None]).logits[0]
        total += float(F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum"))
        count += int((targets != -100).sum())
    return total / count


def _export_and_load(workdir: ZygoteDir, name: str) -> dict:
    import transformers

    out = os.path.join(workdir, f"export-{name}")
    done = shardwise_command(
        workdir.zygote,
        ["checkpoint", "export", "--format", "hf", os.path.join(workdir, "runs", name, "checkpoints"), out],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert transformers.AutoTokenizer.from_pretrained(out).chat_template == hf.CHAT_TEMPLATE
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _kill_and_resume(workdir: ZygoteDir, name: str, *extra: str) -> dict[str, str]:
    full = _train(workdir, name, *extra)
    assert full.returncode == 0, full.stdout + full.stderr
    killed = _train(workdir, name + "-cut", *extra, env={"SHARDWISE_FAULT": "rank=0,step=3,how=raise"})
    assert killed.returncode != 0
    resumed = _train(workdir, name + "-cut", *extra, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    want, got = _losses(workdir, name), _losses(workdir, name + "-cut")
    assert sorted(want) == [1, 2, 3, 4] and [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]
    a, b = _export_and_load(workdir, name), _export_and_load(workdir, name + "-cut")
    assert set(a) == set(b) and all(a[k].equal(b[k]) for k in a)
    return want | {"stdout": full.stdout}


def test_chat_under_tp2_padded_logs_the_assistant_token_mean_and_resumes_exactly(workdir: str) -> None:
    # ~45 s: three 2-process runs (full, killed, resumed) and two exports
    records = [json.loads(line) for line in open(os.path.join(workdir, "chat.jsonl"))]
    losses = _kill_and_resume(
        workdir, "tp", "--plan", "tp=2", "--train.global_batch_size=16", "--data.val_fraction=0.001"
    )
    assert "chat: 1 file(s), 17 record(s), 17 sample(s); padded per batch" in losses["stdout"], losses["stdout"]
    assert "loss_reduction='tokens'" in losses["stdout"]
    want = assistant_token_loss(workdir, records[:16])  # the last record is the validation split
    assert abs(float(losses[1]) - want) <= 1e-5 * want, (losses[1], want)
    everything = assistant_token_loss(
        workdir, records[:16], everything=True
    )  # an untrained model is near-uniform on all tokens
    assert abs(everything - want) > 1e-4 * want, (everything, want)  # yet the mask is 10x the tolerance away


def test_chat_under_dp2_packed_and_streamed_resumes_exactly(workdir: str) -> None:
    # ~45 s: three 2-process runs (full, killed, resumed) and two exports
    from shardwise.data.batching import pack
    from shardwise.data.instruct import InstructFormat, make_examples
    from shardwise.data.records import read_records

    path = os.path.join(workdir, "chat.jsonl")
    tok = hf.load_tokenizer(os.path.join(workdir, "model"))
    rows = len(pack(make_examples(read_records(path), tok, InstructFormat(format="chat"), seq_len=SEQ).pieces, SEQ, 0))
    assert rows % 2 == 0 and rows < 17  # several chats per row; one global batch of all rows splits over dp=2
    losses = _kill_and_resume(
        workdir,
        "dp",
        "--plan",
        "dp=2",
        f"--train.global_batch_size={rows}",
        "--data.packing",
        "true",
        "--data.streaming",
        "true",
        "--data.val_files",
        os.path.join(workdir, "val.jsonl"),
    )
    assert "packed into rows of 128 tokens" in losses["stdout"], losses["stdout"]
    want = assistant_token_loss(workdir, [json.loads(line) for line in open(path)])
    assert abs(float(losses[1]) - want) <= 1e-5 * want, (losses[1], want)
