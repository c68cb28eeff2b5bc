"""What the documented commands assume is there (tests/integration/test_docs_run.py): the user's
scripts, configuration, cluster specs, data under the docs' globs, a small Hugging Face model under
the docs' names for one, and the links to the three fixture runs under the docs' run directories."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

from tests.doc_commands import ROOT

TRAIN_PY = '''"""A user's training script (the docs call it train.py): its arguments and its place in the world."""
import argparse, os
parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()
print(f"train.py rank {os.environ.get('RANK', 0)} of {os.environ.get('WORLD_SIZE', 1)} lr {args.lr}")
'''
MY_MODEL = '''"""The docs' my_model.py: a model for `shardwise plan --script` (MODEL_SPEC) and `shardwise verify
--script` (build_model(seed), make_batch(step, size))."""
import torch
from shardwise.models import GPT, GPTConfig

MODEL_SPEC = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 32}
CONFIG = GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=4)


def build_model(seed: int = 0) -> torch.nn.Module:
    return GPT(CONFIG, seed=seed)


def make_batch(step: int, size: int):
    ids = torch.randint(0, CONFIG.vocab_size, (size, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(step))
    return ids[:, :-1], ids[:, 1:]
'''
# what the commands import beyond a `shardwise train` run (imported once, before the forks)
PRELOAD = ("torch.distributed.tensor", "torch.distributed.fsdp", "shardwise.verify.parity", "shardwise.generate.decode",
           "shardwise.jobs.hf_train", "transformers", "tokenizers", "safetensors.torch", "mlflow.tracking")
HF_NAMES = ("my-hf-model", "models/my-llama", "DIR")  # what the docs call a Hugging Face model directory
# the docs' run directories: the fixture runs (GPT_RUN, HF_RUN) under the names the docs use
# (and LORA_RUN: the LoRA run, `runs/x` in docs/lora.md, `runs/lora` in `shardwise checkpoint --help`)
RUN_LINKS = (
    ("gpt-stdlib-x", "gpt-stdlib-x"),
    ("gpt", "gpt-stdlib-x"),
    ("hf-x", "hf-x"),
    ("ckpt", "hf-x/checkpoints"),
    ("<name>", "hf-x"),
    ("lora-x", "lora-x"),
    ("x", "lora-x"),
    ("lora", "lora-x/checkpoints"),
)


def make_hf_model(directory: str) -> int:
    """A tiny Llama-style model with a BPE tokenizer and a chat template (phase 0 of the run, in a
    forked child)."""
    from shardwise.models import hf

    hf.save_tiny(
        directory, family="llama", texts=_texts() + [_chat_text(c) for c in _chats()], vocab=320, seq=64, chat=True
    )
    return 0


def _texts() -> list[str]:
    folder = os.path.join(sysconfig.get_paths()["stdlib"], "json")
    return [open(os.path.join(folder, n)).read() for n in sorted(os.listdir(folder)) if n.endswith(".py")]


def _chats() -> list[list[dict[str, str]]]:
    """Short conversations (the docs' `sft/*.jsonl`, `data/*.jsonl`), every third with a system prompt."""
    chats = []
    for i in range(24):
        a, b = i % 7 + 2, i % 5 + 3
        turns = [
            {"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"It is {a + b}."},
        ]
        chats.append(([{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []) + turns)
    return chats


def _chat_text(chat: list[dict[str, str]]) -> str:
    return " ".join(m["content"] for m in chat)


def fixtures(fx: Path) -> None:
    (fx / "train.py").write_text(TRAIN_PY)
    (fx / "mypkg").mkdir()
    (fx / "mypkg" / "__init__.py").write_text("")
    (fx / "mypkg" / "train.py").write_text(TRAIN_PY)
    (fx / "my_model.py").write_text(MY_MODEL)
    from shardwise.config import TrainJobConfig, to_toml

    (fx / "run.toml").write_text(to_toml(TrainJobConfig()))
    for name in ("cluster.json", "calibrated.json"):  # a `shardwise calibrate` spec
        shutil.copy(ROOT / "bench" / "results" / "planner_validation_cluster.json", fx / name)
    (fx / "hosts.txt").write_text("node1 slots=8\nnode2 slots=8\n")
    texts = _texts()
    for folder in ("data/nested", "corpus/nested", "path/nested", "notes", "heldout"):
        (fx / folder).mkdir(parents=True)
    for i, text in enumerate(texts[:3]):
        for folder in ("data/nested", "corpus/nested", "path/nested"):
            (fx / folder / f"part{i}.txt").write_text(text)
    for folder in ("notes", "heldout"):
        (fx / folder / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[3:]))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts}), fx / "corpus" / "part0.parquet")
    chats = _chats()
    for folder in ("sft", "data"):  # chat data: `--data.format chat`
        (fx / folder).mkdir(exist_ok=True)
        for i in range(2):
            (fx / folder / f"chats{i}.jsonl").write_text(
                "".join(json.dumps({"messages": c}) + "\n" for c in chats[i::2])
            )
    qa = [(c[-2]["content"], c[-1]["content"]) for c in chats]  # `--data.format prompt_completion`, its own field names
    pq.write_table(pa.table({"question": [q for q, _ in qa], "answer": [a for _, a in qa]}), fx / "qa.parquet")
    (fx / HF_NAMES[0]).mkdir()  # filled by make_hf_model, after the work directories link it
    (fx / "models").mkdir()
    for name in HF_NAMES[1:]:
        os.symlink(fx / HF_NAMES[0], fx / name)
    (fx / "runs").mkdir()


def workdir(fx: Path, cwd: Path) -> None:
    """A fresh directory with the fixtures: small files copied (a command may overwrite them),
    directories linked (the runs' directories one by one, so new runs land in this one)."""
    cwd.mkdir()
    for entry in fx.iterdir():
        if entry.name == "runs":  # the fixture runs may not exist yet: they are made first, in the same call
            (cwd / "runs").mkdir()
            for link, target in RUN_LINKS:
                os.symlink(entry / target, cwd / "runs" / link)
        elif entry.is_dir() or entry.is_symlink():  # the model directory's names: made in the same call
            os.symlink(entry, cwd / entry.name)
        else:
            shutil.copy(entry, cwd / entry.name)
    for name in ("examples", "bench"):
        os.symlink(ROOT / name, cwd / name)
