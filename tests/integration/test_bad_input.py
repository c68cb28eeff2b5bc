"""Bad input to every command: a non-zero exit, one line on stderr, no traceback, no file touched.

Each table below is one command's adversarial inputs. A :class:`Case` is the command line, a
pattern the error line must match, and the files to prepare. Every case runs ``python -m
shardwise`` as a subprocess (hard timeout) in its own copy of a work directory that holds a real
run: a tiny ``shardwise train`` of one process made once per module, with its checkpoints, and a
checkpoint of a model-less job. Every file's bytes and every directory are snapshotted before and
after, so a leftover ``.tmp``, a truncated log or a changed shard fails the case as surely as a
traceback does.

A fresh interpreter spends seconds of CPU importing torch before it reads its arguments, so most
cases run the way the documented commands do (tests/forkrun.py): one process imports torch and
shardwise (and transformers and peft) once and forks a child per case that runs
``shardwise.cli.main(argv)`` (what ``python -m shardwise`` runs), in the case's directory, with its
own stdout/stderr files, environment and timeout. That process's own stderr from its imports is
put in front of every forked case's stderr, so an import-time warning fails the cases as it would
in a fresh interpreter. Cases marked ``unprivileged`` need a file the command cannot read or a
directory it cannot write: as root, their child drops the capabilities that bypass file
permissions before it runs. A few cases still run ``python -m shardwise`` as a subprocess: those
with their own value of a variable an interpreter reads at start-up (``PYTHONPATH``, ``HOME``) and
one case each of ``train``, ``run`` and ``export`` (FRESH_START), which show that the interpreter's
start-up itself (``python -m``, the lazy imports in their real order) prints nothing on stderr.
The two runs every case starts from are made by the same process. All selected cases run
concurrently, one per core.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.forkrun import Zygote, drop_permission_override

TIMEOUT_S = 60
RUN = "runs/base"
CKPT = f"{RUN}/checkpoints"
STEP = f"{CKPT}/step_00000002"
TINY = ("--model.layers=1", "--model.hidden=32", "--model.heads=2", "--model.seq_len=16", "--data.max_chars=20000",
        "--train.global_batch_size=4", "--train.eval_every=0", "--train.eval_windows=4", "--sample.chars=0")
SPEC = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 100, "seq": 32}

Prepare = Callable[[Path], None]


@dataclass(frozen=True)
class Case:
    """One bad command line; ``expect`` is a regex the error line (the last stderr line) must match.
    ``env``: extra environment variables, where ``{home}`` stands for a fresh directory outside the
    work directory. A refusal that only a worker can make, after training started (a bad record
    late in a streamed file), may print up to ``lines`` stderr lines (rank 0's log lines before the
    error, never a dependency's warning: one adds two lines), may create files under ``creates``
    (its own run directory) and gets ``timeout_s``."""

    name: str
    args: tuple[str, ...]
    expect: str
    prepare: tuple[Prepare, ...] = ()
    unprivileged: bool = False
    env: tuple[tuple[str, str], ...] = ()
    lines: int = 1
    creates: str = ""
    timeout_s: int = TIMEOUT_S


def case(name: str, args: list[str], expect: str, *prepare: Prepare, unprivileged: bool = False,
         env: dict[str, str] | None = None, lines: int = 1, creates: str = "", timeout_s: int = TIMEOUT_S) -> Case:
    return Case(
        name, tuple(args), expect, tuple(prepare), unprivileged, tuple((env or {}).items()), lines, creates, timeout_s
    )


# -- preparing files -----------------------------------------------------------------------------
def mkdir(rel: str, mode: int = 0o755) -> Prepare:
    def run(root: Path) -> None:
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel).chmod(mode)

    return run


def write(rel: str, content: str | bytes, mode: int = 0o644) -> Prepare:
    def run(root: Path) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        path.chmod(mode)

    return run


def truncate(rel: str) -> Prepare:
    """Cut a file to half its size (a shard whose write was interrupted)."""

    def run(root: Path) -> None:
        data = (root / rel).read_bytes()
        (root / rel).write_bytes(data[: len(data) // 2])

    return run


class _Bomb:
    """Unpickling this runs ``touch PWNED`` in the case directory (which the snapshot would see)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def bomb(rel: str) -> Prepare:
    """Replace a checkpoint file by a malicious pickle and rewrite the marker's checksum to match."""

    def run(root: Path) -> None:
        (root / rel).write_bytes(pickle.dumps(_Bomb(str(root / "PWNED"))))
        reseal(rel)(root)

    return run


def reseal(rel: str) -> Prepare:
    """Make the commit marker's size and sha256 of ``rel`` match its current bytes."""

    def run(root: Path) -> None:
        step_dir = next(p for p in (root / rel).parents if (p / "COMMITTED.json").exists())
        marker = json.loads((step_dir / "COMMITTED.json").read_text())
        data = (root / rel).read_bytes()
        marker["files"][str((root / rel).relative_to(step_dir))] = {
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        (step_dir / "COMMITTED.json").write_text(json.dumps(marker))

    return run


def copy_dir(src: str, dst: str) -> Prepare:
    def run(root: Path) -> None:
        shutil.copytree(root / src, root / dst)

    return run


def edit_json(rel: str, **changes: object) -> Prepare:
    def run(root: Path) -> None:
        path = root / rel
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return run


def shard_missing(model: str) -> Prepare:
    """Split a model directory's weights the way save_pretrained shards them, by an index, and leave
    the second shard out (an interrupted download): the index names one tensor in a file not there."""

    def run(root: Path) -> None:
        weights = root / model / "model.safetensors"
        data = weights.read_bytes()
        header = json.loads(data[8: 8 + int.from_bytes(data[:8], "little")])
        keys = sorted(k for k in header if k != "__metadata__")
        weight_map = {k: "model-00001-of-00002.safetensors" for k in keys} | {
            keys[-1]: "model-00002-of-00002.safetensors"
        }
        weights.rename(root / model / "model-00001-of-00002.safetensors")
        (root / model / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )

    return run


def edit_marker(step: str, **changes: object) -> Prepare:
    def run(root: Path) -> None:
        path = root / step / "COMMITTED.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))

    return run


# -- the tables ------------------------------------------------------------------------------------
TRAIN_CASES = [
    case("unknown-flag", ["train", "--bogus"], r"unrecognized arguments: --bogus"),
    case("unknown-key", ["train", "--train.lrr=1"], r"--train\.lrr=1"),
    case("nproc-zero", ["train", "--nproc", "0"], r"'parallel\.nproc'.*not a positive integer"),
    case(
        "tp3-on-2-processes",
        ["train", "--nproc", "2", "--plan", "tp=3"],
        r"tp\*pp=3 does not divide the world of 2 processes",
    ),
    case("unknown-plan-key", ["train", "--nproc", "2", "--plan", "dpp=2"], r"unknown plan key 'dpp'"),
    case("config-is-a-directory", ["train", "--config", "conf"], r"config file 'conf' is a directory", mkdir("conf")),
    case(
        "config-unreadable",
        ["train", "--config", "secret.toml"],
        r"config file 'secret\.toml' cannot be read",
        write("secret.toml", "[train]\nlr = 0.1\n", mode=0o000),
        unprivileged=True,
    ),
    case(
        "config-not-toml",
        ["train", "--config", "bad.toml"],
        r"config file 'bad\.toml' is not valid TOML",
        write("bad.toml", "[train\nlr = "),
    ),
    case(
        "config-not-text",
        ["train", "--config", "bin.toml"],
        r"config file 'bin\.toml' is not valid TOML",
        write("bin.toml", b"\xff\xfe\x00[train]"),
    ),
    case(
        "config-wrong-type",
        ["train", "--config", "c.toml"],
        r"'train\.lr' \(from c\.toml\): 'fast' is not a number",
        write("c.toml", "[train]\nlr = 'fast'\n"),
    ),
    # [data] options that only work together
    case(
        "streaming-without-model-hf",
        ["train", "--nproc", "1", "--data.streaming", "true"],
        r"data\.streaming and data\.format are for fine-tuning a Hugging Face",
    ),
    case(
        "val-files-without-streaming",
        ["train", "--nproc", "1", "--model.hf", "m", "--data.files", "a.txt", "--data.val_files", "a.txt"],
        r"data\.val_files is an option of a streamed dataset.*--data\.streaming true",
        write("a.txt", "text"),
    ),
    case(
        "streaming-without-max-steps",
        [
            "train",
            "--nproc",
            "1",
            "--model.hf",
            "m",
            "--data.files",
            "a.txt",
            "--data.streaming",
            "true",
            "--max-steps",
            "0",
        ],
        r"no length known before training.*--max-steps",
        write("a.txt", "text"),
    ),
]

# Instruction data for --model.hf (a chat model and one without a chat template are in the template
# directory): one line naming the file and line, before any process starts.
GOOD_CHAT = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
FT = ("train", "--nproc", "1", "--run.name=ft", "--model.seq_len=32")
TRAIN_CASES_INSTRUCT = [
    case(
        "instruct-line-not-json",
        [*FT, "--model.hf", "chatmodel", "--data.format", "chat", "--data.files", "c.jsonl"],
        r"c\.jsonl:2 is not JSON",
        write("c.jsonl", GOOD_CHAT + "\n{oops\n"),
    ),
    case(
        "instruct-record-without-the-field",
        [*FT, "--model.hf", "chatmodel", "--data.format", "prompt_completion", "--data.files", "p.jsonl"],
        r"p\.jsonl:1 has no field 'completion'.*--data\.completion_key",
        write("p.jsonl", '{"prompt": "a"}\n'),
    ),
    case(
        "chat-without-an-assistant-turn",
        [*FT, "--model.hf", "chatmodel", "--data.format", "chat", "--data.files", "c.jsonl"],
        r"c\.jsonl:2: the chat has no assistant turn",
        write("c.jsonl", GOOD_CHAT + '\n{"messages": [{"role": "user", "content": "x"}]}\n'),
    ),
    case(
        "tokenizer-without-a-chat-template",
        [*FT, "--model.hf", "plainmodel", "--data.format", "chat", "--data.files", "c.jsonl"],
        r"the tokenizer has no chat template",
        write("c.jsonl", GOOD_CHAT + "\n"),
    ),
    case(
        "every-prompt-fills-the-context",
        [
            *FT,
            "--model.hf",
            "chatmodel",
            "--data.format",
            "prompt_completion",
            "--data.files",
            "p.jsonl",
            "--model.seq_len=8",
        ],
        r"none of the 2 record\(s\) leaves a target to learn within the 8-token context",
        write("p.jsonl", "".join(json.dumps({"prompt": "hello " * 20, "completion": "x"}) + "\n" for _ in range(2))),
    ),
    case(
        "packing-text",
        [*FT, "--model.hf", "chatmodel", "--data.files", "a.txt", "--data.packing", "true"],
        r"data\.packing is an option of prompt_completion and chat",
        write("a.txt", "text"),
    ),
    case(
        "packing-under-cp",
        [
            *FT[:2],
            "2",
            *FT[3:],
            "--plan",
            "cp=2",
            "--model.hf",
            "chatmodel",
            "--data.format",
            "chat",
            "--data.files",
            "c.jsonl",
            "--data.packing",
            "true",
        ],
        r"context parallel's split attention cannot keep packed",
        write("c.jsonl", GOOD_CHAT + "\n"),
    ),
    case(
        "instruct-format-without-model-hf",
        ["train", "--nproc", "1", "--data.format", "chat"],
        r"data\.format are for fine-tuning",
    ),
    case(
        "chat-role-the-template-does-not-know",
        [*FT, "--model.hf", "chatmodel", "--data.format", "chat", "--data.files", "c.jsonl"],
        r"c\.jsonl:2: message 1 has role 'asistant', which the tokenizer's chat template does not know",
        write("c.jsonl", GOOD_CHAT + "\n" + GOOD_CHAT.replace('"assistant"', '"asistant"') + "\n"),
    ),
    # the weights of --model.hf, checked from the files' headers before any process starts (also on a resume)
    case(
        "hf-weights-truncated",
        [*FT, "--model.hf", "cut", "--data.format", "chat", "--data.files", "c.jsonl"],
        r"cut/model\.safetensors is truncated: it has \d+ bytes, its header describes \d+",
        copy_dir("chatmodel", "cut"),
        truncate("cut/model.safetensors"),
        write("c.jsonl", GOOD_CHAT + "\n"),
    ),
    case(
        "hf-weights-truncated-on-resume",
        [*FT, "--resume", "auto", "--model.hf", "cut", "--data.format", "chat", "--data.files", "c.jsonl"],
        r"cut/model\.safetensors is truncated",
        copy_dir("chatmodel", "cut"),
        truncate("cut/model.safetensors"),
        write("c.jsonl", GOOD_CHAT + "\n"),
    ),
    case(
        "hf-weights-shard-missing",
        [*FT, "--model.hf", "sharded", "--data.format", "chat", "--data.files", "c.jsonl"],
        r"sharded/model-00002-of-00002\.safetensors is missing: model\.safetensors\.index\.json names it for 1 tensor",
        copy_dir("chatmodel", "sharded"),
        shard_missing("sharded"),
        write("c.jsonl", GOOD_CHAT + "\n"),
    ),
    case(
        "hf-weights-shape-not-the-config",
        [*FT, "--model.hf", "wide", "--data.format", "chat", "--data.files", "c.jsonl"],
        r"wide/model\.safetensors: tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \[\d+, \d+\], but the "
        r"model that "
        r"config\.json describes needs",
        copy_dir("chatmodel", "wide"),
        edit_json("wide/config.json", intermediate_size=512),
        write("c.jsonl", GOOD_CHAT + "\n"),
    ),
    case(
        "qlora-under-tp",
        [
            *FT[:2],
            "2",
            *FT[3:],
            "--plan",
            "tp=2",
            "--model.hf",
            "chatmodel",
            "--data.format",
            "chat",
            "--data.files",
            "c.jsonl",
            "--lora.r",
            "4",
            "--lora.base",
            "nf4",
        ],
        r"tp cannot split QLoRA's 4-bit NF4 base",
        write("c.jsonl", GOOD_CHAT + "\n"),
    ),
    # a bad record after the 1000 the command checks: 2 workers meet it in their second step of 512
    # records each and stop; the launcher prints their one line (after rank 0's log line)
    case(
        "streamed-bad-json-late",
        [
            *FT[:2],
            "2",
            "--run.name=late",
            *FT[4:],
            "--model.hf",
            "chatmodel",
            "--data.format",
            "chat",
            "--data.files",
            "c.jsonl",
            "--data.streaming",
            "true",
            "--max-steps",
            "2",
            "--train.global_batch_size=1024",
        ],
        r"c\.jsonl:1010 is not JSON .*\(raised on ranks 0, 1\)",
        write("c.jsonl", "".join((GOOD_CHAT if i != 1009 else "{oops") + "\n" for i in range(1100))),
        lines=3,
        creates="runs/late/",
        timeout_s=300,
    ),
]

# A refused resume or an unusable run directory: these used to truncate metrics.csv, rewrite
# config.toml, start a tensorboard file and a progress bar, or print a traceback, before the error.
TRAIN_CASES_RUN_DIR = [
    case(
        "resume-other-model-shape",
        ["train", "--nproc", "1", "--run.name=base", "--resume", "auto", *TINY, "--model.hidden=64"],
        r"does not match this model",
    ),
    case(
        "resume-replaced-shard",
        ["train", "--nproc", "1", "--run.name=base", "--resume", "auto", *TINY],
        r"__0_0\.distcp .*it was not loaded",
        bomb(f"{STEP}/__0_0.distcp"),
    ),
    case(
        "runs-dir-not-writable",
        ["train", "--nproc", "1", "--run.runs_dir=ro", *TINY],
        r"(?i)\bro\b.*(writ|permission)",
        mkdir("ro", 0o555),
        unprivileged=True,
    ),
    case(
        "runs-dir-is-a-file",
        ["train", "--nproc", "1", "--run.runs_dir=afile", *TINY],
        r"(?i)afile.*(directory|file)",
        write("afile", "x"),
    ),
]

# --hang-timeout is checked before anything else, with one process too (it used to be checked only
# when launching workers, after the run directory was written).
TRAIN_CASES_HANG_TIMEOUT = [
    case(
        "hang-timeout-negative",
        ["train", "--nproc", "2", "--run.name=h", "--hang-timeout", "-5"],
        r"--hang-timeout -5 is negative",
    ),
    case(
        "hang-timeout-negative-one-process",
        ["train", "--nproc", "1", "--run.name=h", "--hang-timeout", "-5"],
        r"--hang-timeout -5 is negative",
    ),
]

# The [log] tracker: what would fail inside a worker after the processes started (an option the
# tracker does not read, a package that cannot be imported, a store MLflow cannot open or write, a
# server that does not answer, W&B online without a login) is refused before anything starts.
NO_MLFLOW = write(
    "shadow/mlflow/__init__.py", "raise ModuleNotFoundError(\"No module named 'mlflow'\", name='mlflow')\n"
)
MLFLOW = ["train", "--nproc", "1", "--run.name=m", "--log.tracker", "mlflow"]
FILE_STORE = {"MLFLOW_ALLOW_FILE_STORE": "true"}
TRAIN_CASES_TRACKER = [
    case(
        "tracker-unknown",
        ["train", "--nproc", "1", "--log.tracker", "comet"],
        r"'log\.tracker'.*'comet' is not one of none, mlflow, wandb",
    ),
    case(
        "tracker-option-without-tracker",
        ["train", "--nproc", "1", "--log.tracking_uri", "file:///tmp/mlruns"],
        r"'log\.tracking_uri' is set, but log\.tracker is 'none'",
    ),
    case(
        "tracker-option-of-the-other-tracker",
        ["train", "--nproc", "1", "--log.tracker", "wandb", "--log.tracking_uri", "mlruns"],
        r"'log\.tracking_uri' is set, but log\.tracker is 'wandb'",
    ),
    case("tracker-experiment-empty", [*MLFLOW, "--log.experiment="], r"'log\.experiment' is empty"),
    case(
        "mlflow-not-installed",
        [*MLFLOW, "--log.tracking_uri", "mlruns"],
        r"log\.tracker 'mlflow' needs the mlflow package",
        NO_MLFLOW,
        env={"PYTHONPATH": "shadow"},
    ),
    case(
        "mlflow-uri-unknown-scheme",
        [*MLFLOW, "--log.tracking_uri", "bogus://x"],
        r"'bogus://x'.*MLflow has no tracking store for this scheme",
    ),
    case("mlflow-uri-not-a-uri", [*MLFLOW, "--log.tracking_uri", "http://[::1"], r"'http://\[::1' is not a URI"),
    case(
        "mlflow-file-store-switched-off",
        [*MLFLOW, "--log.tracking_uri", "mlruns"],
        r"file store.*MLFLOW_ALLOW_FILE_STORE=true",
        env={"MLFLOW_ALLOW_FILE_STORE": "false"},
    ),
    case(
        "mlflow-file-store-not-writable",
        [*MLFLOW, "--log.tracking_uri", "ro/mlruns"],
        r"'ro/mlruns'.*is not writable",
        mkdir("ro", 0o555),
        unprivileged=True,
        env=FILE_STORE,
    ),
    case(
        "mlflow-file-store-under-a-file",
        [*MLFLOW, "--log.tracking_uri", "file:afile/mlruns"],
        r"'afile' is a file, not a directory",
        write("afile", "x"),
        env=FILE_STORE,
    ),
    case(
        "mlflow-server-not-answering",
        [*MLFLOW, "--log.tracking_uri", "http://127.0.0.1:9"],
        r"no tracking server answers at 127\.0\.0\.1:9",
    ),
    case(
        "wandb-online-without-login",
        ["train", "--nproc", "1", "--log.tracker", "wandb", "--log.wandb_mode", "online"],
        r"'wandb' in online mode needs a W&B login",
        env={"HOME": "{home}", "WANDB_API_KEY": ""},
    ),
]

RUN_CASES = [
    case("unknown-flag", ["run", "--bogus", "ok.py"], r"unrecognized arguments: --bogus"),
    case("missing-script", ["run", "missing.py"], r"script 'missing\.py' does not exist"),
    case("script-is-a-directory", ["run", "adir"], r"script 'adir' is a directory", mkdir("adir")),
    case("nproc-zero", ["run", "--nproc-per-node", "0", "ok.py"], r"--nproc-per-node 0 must be at least 1"),
    case("master-port-out-of-range", ["run", "--master-port", "70000", "ok.py"], r"--master-port 70000 is not a port"),
    case(
        "hang-timeout-nan", ["run", "--hang-timeout", "nan", "ok.py"], r"--hang-timeout nan is not a number of seconds"
    ),
    case(
        "log-dir-is-a-file",
        ["run", "--log-dir", "afile", "ok.py"],
        r"--log-dir 'afile' is not a directory",
        write("afile", "x"),
    ),
]

SLURM_CASES = [
    case("time-word", ["slurm", "--time", "forever", "--", "t.py"], r"--time 'forever' is not a Slurm time"),
    case("time-seconds-over-59", ["slurm", "--time", "10:75", "--", "t.py"], r"--time '10:75' is not a Slurm time"),
    case("cpus-zero", ["slurm", "--cpus-per-task", "0", "--", "t.py"], r"--cpus-per-task 0 must be at least 1"),
    case(
        "job-name-with-newline",
        ["slurm", "--job-name", "a\nrm -rf ~", "--", "t.py"],
        r"--job-name .* contains whitespace",
    ),
    case(
        "out-in-missing-directory",
        ["slurm", "--out", "nodir/job.sbatch", "--", "t.py"],
        r"--out nodir/job\.sbatch: directory .* does not exist",
    ),
    case(
        "out-not-writable",
        ["slurm", "--out", "ro/job.sbatch", "--", "t.py"],
        r"--out ro/job\.sbatch: directory .* is not writable",
        mkdir("ro", 0o555),
        unprivileged=True,
    ),
]

DOCTOR_CASES = [
    case("iters-zero", ["doctor", "--iters", "0"], r"--iters 0 must be a positive integer"),
    case("nproc-negative", ["doctor", "--nproc", "-1"], r"--nproc -1 is negative"),
    case("max-size-nan", ["doctor", "--max-size-mb", "nan"], r"--max-size-mb nan must be a positive number"),
    case("plot-is-a-directory", ["doctor", "--plot", "adir"], r"--plot adir is a directory", mkdir("adir")),
    case("plot-unknown-format", ["doctor", "--plot", "bw.txt"], r"--plot bw\.txt: \.txt is not a plot format"),
    case("plot-not-writable", ["doctor", "--plot", "ro/bw.png"], r"--plot ro/bw\.png: directory .* is not writable",
         mkdir("ro", 0o555), unprivileged=True),
]

VERIFY_CASES = [
    case("tp-does-not-divide-the-vocabulary", ["verify", "--plan", "tp=3"], r"tp=3 does not divide"),
    case(
        "global-batch-zero",
        ["verify", "--plan", "dp=2", "--global-batch", "0"],
        r"--global-batch 0 must be a positive integer",
    ),
    case(
        "accumulation-zero",
        ["verify", "--plan", "dp=2", "--accumulation", "0"],
        r"--accumulation 0 must be a positive integer",
    ),
    case("rtol-nan", ["verify", "--plan", "dp=2", "--rtol", "nan"], r"--rtol nan must be a non-negative number"),
    case("timeout-zero", ["verify", "--plan", "dp=2", "--timeout", "0"], r"--timeout 0 must be a positive number"),
    case(
        "script-is-a-directory",
        ["verify", "--plan", "dp=2", "--script", "adir"],
        r"--script 'adir' is a directory",
        mkdir("adir"),
    ),
]

PLAN_CASES = [
    case("spec-not-json", ["plan", "--model-spec", '{"layers": 2,', "--devices", "4"], r"not JSON"),
    case(
        "spec-file-missing",
        ["plan", "--model-spec", "spec.json", "--devices", "4"],
        r"--model-spec 'spec\.json' is neither a JSON object nor an existing file",
    ),
    case(
        "spec-file-is-a-directory",
        ["plan", "--model-spec", "adir", "--devices", "4"],
        r"--model-spec 'adir' is a directory",
        mkdir("adir"),
    ),
    case(
        "spec-file-unreadable",
        ["plan", "--model-spec", "spec.json", "--devices", "4"],
        r"--model-spec 'spec\.json' cannot be read",
        write("spec.json", json.dumps(SPEC), mode=0o000),
        unprivileged=True,
    ),
    case(
        "device-type-is-a-directory",
        ["plan", "--model", "gpt", "--devices", "4", "--device-type", "adir"],
        r"--device-type 'adir' is a directory",
        mkdir("adir"),
    ),
]

CALIBRATE_CASES = [
    case("iters-zero", ["calibrate", "--iters", "0"], r"--iters 0 must be a positive integer"),
    case("max-size-nan", ["calibrate", "--max-size-mb", "nan"], r"--max-size-mb nan must be a positive number"),
    case("out-is-a-directory", ["calibrate", "--out", "adir"], r"--out adir is a directory", mkdir("adir")),
    case("out-not-writable", ["calibrate", "--out", "ro/c.json"], r"--out ro/c\.json: directory .* is not writable",
         mkdir("ro", 0o555), unprivileged=True),
]

INSPECT_CASES = [
    case("empty-directory", ["checkpoint", "inspect", "empty"], r"no checkpoints in empty", mkdir("empty")),
    case("run-directory-not-checkpoints", ["checkpoint", "inspect", RUN], r"no checkpoints in runs/base"),
    case(
        "step-that-does-not-exist", ["checkpoint", "inspect", CKPT, "--step", "99"], r"no step 99 in .*\(steps: 1, 2\)"
    ),
    case(
        "step-not-complete",
        ["checkpoint", "inspect", CKPT, "--step", "2"],
        r"step 2 .* is not complete",
        write(f"{STEP}/COMMITTED.json", "{not json"),
    ),
    case(
        "metadata-not-a-pickle",
        ["checkpoint", "inspect", CKPT],
        r"\.metadata is not a readable checkpoint index",
        write(f"{STEP}/.metadata", b"garbage"),
        reseal(f"{STEP}/.metadata"),
    ),
    case(
        "metadata-pickle-bomb",
        ["checkpoint", "inspect", CKPT],
        r"refers to (posix|os)\.system",
        bomb(f"{STEP}/.metadata"),
    ),
]

CONSOLIDATE_CASES = [
    case(
        "step-other-than-the-directory",
        ["checkpoint", "consolidate", STEP, "m.safetensors", "--step", "1"],
        r"step 2, not --step 1",
    ),
    case(
        "step-directory-truncated-shard",
        ["checkpoint", "consolidate", STEP, "m.safetensors"],
        r"__0_0\.distcp has \d+ bytes",
        truncate(f"{STEP}/__0_0.distcp"),
    ),
    case(
        "root-step-truncated-shard",
        ["checkpoint", "consolidate", CKPT, "m.safetensors", "--step", "2"],
        r"__0_0\.distcp has \d+ bytes",
        truncate(f"{STEP}/__0_0.distcp"),
    ),
    case(
        "marker-wrong-types",
        ["checkpoint", "consolidate", STEP, "m.safetensors"],
        r"no complete checkpoint",
        edit_marker(STEP, files=["__0_0.distcp"]),
    ),
    case(
        "shard-pickle-bomb",
        ["checkpoint", "consolidate", STEP, "m.safetensors"],
        r"__0_0\.distcp .*it was not loaded",
        bomb(f"{STEP}/__0_0.distcp"),
    ),
    case("no-model-tensors", ["checkpoint", "consolidate", "counters", "m.safetensors"], r"holds no model tensors"),
    case(
        "output-in-missing-directory",
        ["checkpoint", "consolidate", CKPT, "nodir/m.safetensors"],
        r"output nodir/m\.safetensors: directory .* does not exist",
    ),
    case(
        "output-not-writable",
        ["checkpoint", "consolidate", CKPT, "ro/m.safetensors"],
        r"output ro/m\.safetensors: directory .* is not writable",
        mkdir("ro", 0o555),
        unprivileged=True,
    ),
    case(
        "output-is-a-directory",
        ["checkpoint", "consolidate", CKPT, "adir"],
        r"output adir is a directory",
        mkdir("adir"),
    ),
    case(
        "output-is-a-shard", ["checkpoint", "consolidate", CKPT, f"{STEP}/__0_0.distcp"], r"lies inside the checkpoint"
    ),
    case(
        "output-inside-the-step",
        ["checkpoint", "consolidate", STEP, f"{STEP}/m.safetensors"],
        r"lies inside the checkpoint",
    ),
    case(
        "output-is-the-latest-pointer",
        ["checkpoint", "consolidate", CKPT, f"{CKPT}/latest"],
        r"lies inside the checkpoint",
    ),
]

# The template's run is the built-in GPT job (2 heads, context 16), whose checkpoints keep its
# shape and characters in gpt/model.json; "counters" is a checkpoint that keeps no model config.
GPT_FILE = f"{CKPT}/gpt/model.json"
GENERATE_CASES = [
    case(
        "checkpoint-without-model-config",
        ["generate", "--checkpoint", "counters", "--prompt", "x"],
        r"checkpoint counters keeps no model config",
    ),
    case(
        "model-file-not-json",
        ["generate", "--checkpoint", CKPT, "--prompt", "x"],
        r"model\.json is not a shardwise GPT model file \(not JSON\)",
        write(GPT_FILE, "{not json"),
    ),
    case(
        "model-file-without-vocabulary",
        ["generate", "--checkpoint", CKPT, "--prompt", "x"],
        r"needs a \"shape\" object and a \"vocab\" string",
        write(GPT_FILE, json.dumps({"format": "shardwise-gpt", "version": 1, "shape": {"layers": 1}})),
    ),
    case(
        "tp-does-not-divide-the-heads",
        ["generate", "--checkpoint", CKPT, "--prompt", "x", "--plan", "tp=3"],
        r"tp=3 does not divide .*heads=2",
    ),
    case(
        "pipeline-plan",
        ["generate", "--checkpoint", CKPT, "--prompt", "x", "--plan", "pp=2"],
        r"does not run under pipeline parallelism",
    ),
    case(
        "sequence-parallel-plan",
        ["generate", "--checkpoint", CKPT, "--prompt", "x", "--plan", "tp=2,sp"],
        r"does not run under sequence parallelism",
    ),
    case(
        "run-directory-not-checkpoints",
        ["generate", "--checkpoint", RUN, "--prompt", "x"],
        r"runs/base is a run directory.*runs/base/checkpoints",
    ),
    case(
        "prompt-outside-the-vocabulary",
        ["generate", "--checkpoint", CKPT, "--prompt", "x\u00e9"],
        r"vocabulary lacks: '\u00e9'",
    ),
    case(
        "prompt-id-outside-the-vocabulary",
        ["generate", "--checkpoint", CKPT, "--prompt-ids", "1,500"],
        r"prompt id 500 is outside",
    ),
    case(
        "longer-than-the-context",
        ["generate", "--checkpoint", CKPT, "--prompt", "def ", "--max-new-tokens", "20"],
        r"needs 23 positions; the model's context is 16",
    ),
]

# Hugging Face models (the template's chat model and a LoRA run on it, runs/lora, whose checkpoint
# records the template's own chat model as its base: the export cases name the case's copy with
# --model): weights checked from the files' headers and the plan against the model built on meta,
# before any process starts.
LORA_CKPT = "runs/lora/checkpoints"
GENERATE_CASES_HF = [
    case(
        "hf-directory-truncated",
        ["generate", "--checkpoint", "cut", "--prompt", "hi"],
        r"cut/model\.safetensors is truncated",
        copy_dir("chatmodel", "cut"),
        truncate("cut/model.safetensors"),
    ),
    case(
        "hf-directory-shape-not-the-config",
        ["generate", "--checkpoint", "wide", "--prompt", "hi"],
        r"wide/model\.safetensors: tensor '.*' has shape",
        copy_dir("chatmodel", "wide"),
        edit_json("wide/config.json", intermediate_size=512),
    ),
    case(
        "lora-run-tp-does-not-divide",
        ["generate", "--checkpoint", LORA_CKPT, "--prompt", "hi", "--plan", "tp=3"],
        r"tp=3 does not divide",
    ),
]
EXPORT_CASES = [
    case(
        "merge-onto-a-truncated-base",
        ["checkpoint", "export", "--format", "hf", "--merge", LORA_CKPT, "out", "--model", "chatmodel"],
        r"chatmodel/model\.safetensors is truncated",
        truncate("chatmodel/model.safetensors"),
    ),
    case(
        "merge-onto-a-base-missing-a-shard",
        ["checkpoint", "export", "--format", "hf", "--merge", LORA_CKPT, "out", "--model", "chatmodel"],
        r"model-00002-of-00002\.safetensors is missing",
        shard_missing("chatmodel"),
    ),
]

HF = bool(importlib.util.find_spec("transformers") and importlib.util.find_spec("peft"))
# what the Hugging Face cases import, once in the process the cases are forked from (seconds each otherwise)
HF_PRELOAD = ("transformers.models.auto.modeling_auto", "transformers.models.llama.modeling_llama", "peft")
TABLES = {
    "train": TRAIN_CASES
    + TRAIN_CASES_RUN_DIR
    + TRAIN_CASES_HANG_TIMEOUT
    + TRAIN_CASES_TRACKER
    + (TRAIN_CASES_INSTRUCT if importlib.util.find_spec("transformers") else []),
    "run": RUN_CASES,
    "slurm": SLURM_CASES,
    "doctor": DOCTOR_CASES,
    "verify": VERIFY_CASES,
    "plan": PLAN_CASES,
    "calibrate": CALIBRATE_CASES,
    "inspect": INSPECT_CASES,
    "consolidate": CONSOLIDATE_CASES,
    "generate": GENERATE_CASES + (GENERATE_CASES_HF if HF else []),
    **({"export": EXPORT_CASES} if HF else {}),
}
ALL = [(command, c) for command, cases in TABLES.items() for c in cases]
# a fresh interpreter's start-up prints nothing (the module doc): one case each of a training
# command, the launcher and a Hugging Face command
FRESH_START = {TRAIN_CASES[0], RUN_CASES[0], *(EXPORT_CASES[:1] if HF else [])}


# -- the harness -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str
    changes: list[str]  # created, modified or deleted paths


def snapshot(root: Path) -> dict[str, str]:
    """Every directory and file under ``root`` with a digest of its bytes (or its size, if unreadable)."""
    state = {}
    for base, dirs, files in os.walk(root):
        for name in dirs:
            state[os.path.relpath(os.path.join(base, name), root) + "/"] = "dir"
        for name in files:
            path = os.path.join(base, name)
            try:
                with open(path, "rb") as fh:
                    state[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
            except PermissionError:
                state[os.path.relpath(path, root)] = f"unreadable, {os.path.getsize(path)} bytes"
    return state


def _diff(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return (
        [f"created {p}" for p in sorted(after.keys() - before.keys())]
        + [f"deleted {p}" for p in sorted(before.keys() - after.keys())]
        + [f"modified {p}" for p in sorted(before.keys() & after.keys()) if before[p] != after[p]]
    )


def _environment(root: Path) -> dict[str, str]:
    """Ours, without a launcher's variables (inside Slurm or mpirun `run` would behave differently)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "SHARDWISE_FAULT"))
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONWARNINGS"):
        env.pop(key, None)
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLCONFIGDIR": str(root / ".mpl"),
    }


def shardwise(args: tuple[str, ...], cwd: Path, *, env: dict[str, str], unprivileged: bool = False,
              timeout_s: float = TIMEOUT_S) -> tuple[int | None, str, str]:
    """``python -m shardwise ARGS`` in ``cwd``; the whole process group is killed at the timeout."""
    as_root = unprivileged and os.geteuid() == 0
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardwise", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=drop_permission_override if as_root else None,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


@dataclass(frozen=True)
class Prepared:
    """A case's directory, ready to run in, and the snapshot taken before the run."""

    case: Case
    root: Path
    home: Path
    before: dict[str, str]


def prepare_case(c: Case, template: Path, scratch: Path) -> Prepared:
    root = Path(tempfile.mkdtemp(dir=scratch))
    shutil.copytree(template, root, dirs_exist_ok=True, symlinks=True)
    for prepare in c.prepare:
        prepare(root)
    before = snapshot(root)
    return Prepared(c, root, Path(tempfile.mkdtemp(dir=scratch)), before)


def run_case(p: Prepared) -> Outcome:
    """``python -m shardwise`` in a fresh interpreter."""
    env = {**_environment(p.home), **{key: value.format(home=p.home) for key, value in p.case.env}}
    returncode, out, err = shardwise(
        p.case.args, p.root, env=env, unprivileged=p.case.unprivileged, timeout_s=p.case.timeout_s
    )
    return Outcome(returncode, out, err, _diff(p.before, snapshot(p.root)))


# variables an interpreter reads when it starts (a forked child would start with the parent's);
# the others (MLFLOW_ALLOW_FILE_STORE...) are read by the command and are set in the forked child
STARTUP_ENV = frozenset({"PYTHONPATH", "HOME"})


def needs_fresh_interpreter(c: Case) -> bool:
    return c in FRESH_START or any(key in STARTUP_ENV for key, _ in c.env)


def run_forked(zygote: Zygote, prepared: list[Prepared]) -> dict[Case, Outcome]:
    """The cases forked from one process that imported torch and shardwise (tests/forkrun.py); what
    that process printed while importing comes first in each case's stderr."""
    if not prepared:
        return {}
    jobs = [
        {
            "id": str(i),
            "kind": "shardwise",
            "argv": list(p.case.args),
            "cwd": str(p.root),
            "timeout_s": p.case.timeout_s,
            "env": {"MPLCONFIGDIR": str(p.home / ".mpl"), **{k: v.format(home=p.home) for k, v in p.case.env}},
            "stdout": str(p.home / "stdout"),
            "stderr": str(p.home / "stderr"),
            "unprivileged": p.case.unprivileged,
        }
        for i, p in enumerate(prepared)
    ]
    results = zygote.run([jobs], parallel=2)
    imports = Path(zygote.log).read_text(errors="replace")
    outcomes = {}
    for i, p in enumerate(prepared):
        rc = results[str(i)]["rc"]
        outcomes[p.case] = Outcome(None if rc == "timeout" else rc, (p.home / "stdout").read_text(errors="replace"),
                                   imports + (p.home / "stderr").read_text(errors="replace"),
                                   _diff(p.before, snapshot(p.root)))
    return outcomes


def start_zygote(scratch: Path) -> Zygote:
    """The process the cases and the template's runs fork from, in the cases' environment."""
    server_env: dict[str, str | None] = {k: None for k in os.environ}
    server_env.update(_environment(scratch))
    preload = ("shardwise.checkpoint", "shardwise.generate.decode", *(HF_PRELOAD if HF else ()))
    return Zygote(env=server_env, preload=preload, log=str(scratch / "zygote.log"), quiet_dependencies=True)


class _Counter:
    """The one component of a checkpoint without a model."""

    def state_dict(self) -> dict[str, int]:
        return {"value": 3}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def _make_template(root: Path, zygote: Zygote) -> None:
    """The files every case starts from: a real one-process run with two checkpoints (and, with
    transformers and peft, a LoRA run on a small chat model), a checkpoint without a model, and a
    trivial script."""
    from shardwise.checkpoint import CheckpointManager

    assert CheckpointManager(str(root / "counters")).save({"counter": _Counter()}, step=1)
    (root / "ok.py").write_text("pass\n")
    runs = {"base": ("train", "--nproc", "1", "--run.name=base", "--max-steps", "2", *TINY,
                     "--checkpoint.every_n_steps=1")}
    if importlib.util.find_spec("transformers"):  # a model with a chat template and one without (instruction data)
        from shardwise.models import hf

        for name, chat in (("chatmodel", True), ("plainmodel", False)):
            hf.save_tiny(str(root / name), texts=["hello there, " * 20], vocab=140, seq=32, chat=chat)
    if HF:  # a LoRA run on the chat model (the generate and export cases)
        (root / "lora.jsonl").write_text("".join(GOOD_CHAT + "\n" for _ in range(8)))
        runs["lora"] = ("train", "--nproc", "1", "--run.name=lora", "--max-steps", "1", "--model.hf", "chatmodel",
                        "--model.seq_len=32", "--data.format", "chat", "--data.files", "lora.jsonl", "--lora.r", "4",
                        "--train.global_batch_size=4", "--checkpoint.every_n_steps=1")
    logs = root.parent / "template-logs"
    logs.mkdir(exist_ok=True)
    jobs = [{"id": name, "kind": "shardwise", "argv": list(argv), "cwd": str(root), "env": _environment(root),
             "stdout": str(logs / f"{name}.out"), "stderr": str(logs / f"{name}.err"), "timeout_s": 180}
            for name, argv in runs.items()]
    results = zygote.run([jobs], parallel=2)
    for name in runs:
        assert results[name]["rc"] == 0, (logs / f"{name}.out").read_text() + (logs / f"{name}.err").read_text()
    assert sorted(p.name for p in (root / CKPT).glob("step_*")) == ["step_00000001", "step_00000002"]
    shutil.rmtree(root / ".mpl", ignore_errors=True)


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """Where the cases' directories go; removed at the end, read-only ones included."""
    path = Path(tempfile.mkdtemp(prefix="shardwise-bad-input-"))
    yield path
    for base, dirs, _files in os.walk(path):  # the read-only and unreadable files of the cases
        for name in dirs:
            os.chmod(os.path.join(base, name), 0o755)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, scratch: Path) -> Iterator[Callable[[Case], Outcome]]:
    """Run the cases selected in this session concurrently; each test waits for its own."""
    template = scratch / "template"
    template.mkdir(mode=0o755)
    zygote = start_zygote(scratch)
    try:
        _make_template(template, zygote)
        selected = [item.callspec.params["case"] for item in request.session.items if item.module is request.module
                    and "case" in getattr(getattr(item, "callspec", None), "params", {})]
        prepared = [prepare_case(c, template, scratch) for c in selected]
        fresh = [p for p in prepared if needs_fresh_interpreter(p.case)]
        forked = [p for p in prepared if p not in fresh]
        # one thread forks the cases from the zygote (two at a time, one per core); the other runs
        # the fresh interpreters one after the other
        pool = ThreadPoolExecutor(max_workers=2)
        batch = pool.submit(run_forked, zygote, forked)
        futures: dict[Case, Future[Outcome]] = {p.case: pool.submit(run_case, p) for p in fresh}
        try:
            yield lambda c: futures[c].result() if c in futures else batch.result()[c]
        finally:
            pool.shutdown(cancel_futures=True)  # after -x or ^C, the cases not started yet are dropped
    finally:
        zygote.close()


@pytest.mark.parametrize("case", [c for _, c in ALL], ids=[f"{command}-{c.name}" for command, c in ALL])
def test_bad_input_is_one_line_and_touches_nothing(case: Case, outcomes: Callable[[Case], Outcome]) -> None:
    result = outcomes(case)
    shown = (
        f"exit code {result.returncode}\n--- stdout ---\n{result.stdout[-3000:]}\n"
        f"--- stderr ---\n{result.stderr[-3000:]}"
    )
    assert result.returncode is not None, f"no answer within {case.timeout_s} s\n{shown}"
    assert result.returncode != 0, shown
    assert "Traceback" not in result.stdout + result.stderr, shown
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert 1 <= len(lines) <= case.lines, shown
    assert re.match(r"shardwise( [a-z]+)*: error: ", lines[-1]), shown
    assert re.search(case.expect, lines[-1]), f"{case.expect!r} not in {lines[-1]!r}"
    changes = [c for c in result.changes if not (case.creates and c.startswith(f"created {case.creates}"))]
    assert not changes, f"files changed: {changes}\n{shown}"
