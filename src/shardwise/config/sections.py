"""The tables of ``shardwise train``'s job configuration (``[run]``, ``[model]``, ``[data]``,
``[train]``, ``[parallel]``, ``[sample]``, ``[checkpoint]``, ``[log]``, ``[lora]``) and
:class:`TrainJobConfig`, one attribute per table. Each key's default and help live here; the
reference table of ``shardwise train --help`` is generated from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from shardwise.config.schema import Section, opt
from shardwise.errors import ConfigError
from shardwise.shape import TransformerShape

# -- the sections of `shardwise train` -------------------------------------------------------
# The [model] table is the one transformer shape (shardwise.shape), limited to the keys the
# built-in GPT implements and the job does not set itself, plus `hf`: a Hugging Face model
# directory to fine-tune instead (its config.json gives the shape; seq_len is the window length).
MODEL_KEYS = (
    "hf",
    "layers",
    "hidden",
    "heads",
    "ffn",
    "seq_len",
    "dropout",
    "experts",
    "top_k",
    "expert_ffn",
    "aux_loss",
)


@dataclass(frozen=True)
class ModelSection(TransformerShape):
    """The ``[model]`` table: the built-in GPT's shape, or ``hf``: a Hugging Face model directory."""

    hf: str = opt(
        "",
        "a Hugging Face model directory (config.json, safetensors, tokenizer) to fine-tune instead of the built-in GPT",
    )

    def shape(self) -> TransformerShape:
        """The shape without the ``hf`` key."""
        return TransformerShape(**{k: v for k, v in self.to_dict().items() if k != "hf"})


@dataclass(frozen=True)
class RunSection(Section):
    section: ClassVar[str] = "run"
    name: str = opt("", "run name: logs go to <runs_dir>/<name>/ (empty: gpt-stdlib-<date>-<time>)")
    runs_dir: str = opt("runs", "parent directory of the run directories")
    seed: int = opt(0, "seed of the model initialization, the data order and the sample", min=0)


@dataclass(frozen=True)
class DataSection(Section):
    section: ClassVar[str] = "data"
    files: str = opt(
        "",
        "text, JSONL or parquet files to train on: comma-separated globs, e.g. 'data/**/*.txt' (needs model.hf; "
        "empty: the standard library's source)",
    )
    text_key: str = opt("text", "the field of each JSONL line (or the parquet column) that holds the text")
    max_chars: int = opt(1_000_000, "characters of standard-library source to read", min=1000)
    val_fraction: float = opt(0.1, "last fraction of the text kept for validation", min=0.001, max=0.49)
    num_workers: int = opt(0, "DataLoader worker processes per rank", min=0)
    streaming: bool = opt(
        False,
        "read data.files as a stream: packed as read, sharded over ranks and workers, resumed exactly "
        "(needs model.hf and train.max_steps; validation from data.val_files)",
    )
    val_files: str = opt("", "with data.streaming: files loaded whole as the validation split (empty: no validation)")
    shuffle_windows: int = opt(
        0, "with data.streaming: shuffle the windows within blocks of this many (0: in order)", min=0
    )
    format: Literal["text", "prompt_completion", "chat"] = opt(
        "text",
        "what data.files hold: text (packed as continued pre-training), "
        "prompt_completion records or chat records (JSONL or parquet)",
    )
    prompt_key: str = opt("prompt", "prompt_completion: the field holding the prompt")
    completion_key: str = opt("completion", "prompt_completion: the field holding the completion")
    messages_key: str = opt("messages", "chat: the field holding the list of {role, content} messages")
    train_on: Literal["completion", "prompt"] = opt(
        "completion",
        "what the loss covers: the completion or the assistant turns only, or the prompt too (every token)",
    )
    packing: bool = opt(
        False,
        "prompt_completion and chat: pack samples into rows of model.seq_len (positions restart and no token "
        "attends across a sample boundary) instead of padding each",
    )


@dataclass(frozen=True)
class TrainSection(Section):
    section: ClassVar[str] = "train"
    max_steps: int = opt(400, "optimizer steps (0: no step limit, use max_epochs)", min=0)
    max_epochs: int = opt(0, "epochs over the training windows (0: no epoch limit)", min=0)
    global_batch_size: int = opt(64, "sequences per optimizer step over all ranks and micro-steps", min=1)
    grad_accum_steps: int = opt(1, "micro-steps per optimizer step (gradient accumulation)", min=1)
    lr: float = opt(3e-3, "peak learning rate (for the reference world size, see scale_lr)", min=0.0)
    scale_lr: Literal["none", "linear", "sqrt"] = opt(
        "none", "scale lr with the data-parallel size (Goyal et al. 2017)"
    )
    warmup_steps: int = opt(50, "linear warmup steps, then cosine decay", min=0)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak", min=0.0, max=1.0)
    weight_decay: float = opt(0.1, "AdamW weight decay", min=0.0)
    optimizer: Literal["adamw", "muon"] = opt(
        "adamw",
        "adamw, or muon: Muon on the hidden matrices (exact under every plan), AdamW at train.lr "
        "on embeddings, head, norms and biases",
    )
    muon_lr: float = opt(0.02, "with train.optimizer muon: Muon's peak learning rate", min=0.0)
    clip_grad_norm: float = opt(1.0, "clip the global gradient norm to this (0: off)", min=0.0)
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = opt(
        "fp32", "compute precision (bf16/fp16 autocast; fp8: torchao float8 Linear layers, bf16 elsewhere)"
    )
    eval_every: int = opt(100, "evaluate every N steps (0: only at the end)", min=0)
    eval_windows: int = opt(0, "validation windows per evaluation (0: the whole split)", min=0)
    log_every: int = opt(10, "log metrics every N steps", min=1)
    loss_reduction: Literal["tokens", "samples"] = opt(
        "tokens",
        "how micro-batch losses are weighted: by their valid targets "
        "(the global token mean under every plan) or equally (per-sample losses)",
    )


@dataclass(frozen=True)
class ParallelSection(Section):
    section: ClassVar[str] = "parallel"
    plan: str = opt(
        "dp", "parallel plan: 'dp' (all ranks data parallel), 'auto' (the planner picks) or e.g. 'dp=2,tp=2'"
    )
    nproc: str = opt("auto", "local processes: a number, or 'auto' (one per GPU, else one per core up to 4)")
    params16: bool = opt(
        False,
        "16-bit parameters for compute (FSDP2 mixed precision, fp32 masters, no autocast; needs train.precision "
        "bf16 or fp16): adds params16 to the plan",
    )
    chunked_loss: bool = opt(
        False,
        "LM head + cross-entropy chunk by chunk inside the loss (the full logits never held): adds "
        "chunked_loss to the plan",
    )
    sharded_accumulation: bool = opt(
        False,
        "ZeRO-2/3 with train.grad_accum_steps > 1: reduce-scatter every micro-step instead of "
        "holding unsharded gradients: adds sharded_accumulation to the plan",
    )

    def plan_text(self) -> str:
        """``plan`` with the options set here added to it (a plan string names them too:
        ``zero=3,chunked_loss``); ``auto`` takes none (the planner chooses them)."""
        options = [name for name in ("params16", "chunked_loss", "sharded_accumulation") if getattr(self, name)]
        base = self.plan.strip()
        if not options:
            return base
        if base.lower() == "auto":
            raise ConfigError(
                f"config key 'parallel.{options[0]}' cannot be set with parallel.plan = 'auto': the planner chooses "
                "the runtime options",
                hint=f"name a plan instead, e.g. --plan zero=3,{options[0]}",
            )
        named = "" if base.lower() in ("dp", "ddp", "", "single", "none") else base
        return ",".join([named, *options] if named else options)


@dataclass(frozen=True)
class SampleSection(Section):
    section: ClassVar[str] = "sample"
    chars: int = opt(200, "characters to generate at the end (0: none)", min=0)
    prompt: str = opt("def ", "text the sample starts from")
    temperature: float = opt(0.8, "sampling temperature", min=0.01)
    top_k: int = opt(0, "sample among the k most likely characters (0: all)", min=0)


@dataclass(frozen=True)
class CheckpointSection(Section):
    section: ClassVar[str] = "checkpoint"
    every_n_steps: int = opt(0, "save every N steps into <run dir>/checkpoints (0: only at the end)", min=0)
    keep_last_n: int = opt(3, "complete checkpoints kept", min=1)
    async_save: bool = opt(False, "write checkpoints in the background while training continues")
    resume: Literal["never", "auto"] = opt("never", "'auto': continue from the newest complete checkpoint of run.name")


@dataclass(frozen=True)
class LogSection(Section):
    section: ClassVar[str] = "log"
    tracker: Literal["none", "mlflow", "wandb"] = opt(
        "none", "experiment tracker that also gets the metrics, this configuration and the plan"
    )
    experiment: str = opt("shardwise", "the MLflow experiment or the W&B project the run is logged under")
    tracking_uri: str = opt(
        "",
        "MLflow's store: file:///abs/mlruns, sqlite:///mlflow.db, http://host:5000 (empty: MLFLOW_TRACKING_URI "
        "or MLflow's default)",
    )
    wandb_mode: Literal["auto", "online", "offline"] = opt(
        "auto", "W&B's mode ('offline': only files under <run dir>/wandb; 'auto': WANDB_MODE, else online)"
    )
    progress_every_s: float = opt(
        30.0,
        "seconds between rank 0's progress lines (step, loss, tokens/s, ETA) when its output is "
        "not a terminal (a log file, Slurm, CI); a terminal shows a progress bar",
        min=0.1,
    )


@dataclass(frozen=True)
class LoraSection(Section):
    """The ``[lora]`` table: LoRA adapters (peft) on a frozen ``model.hf`` base; QLoRA with ``base = "nf4"``."""

    section: ClassVar[str] = "lora"
    r: int = opt(
        0, "LoRA rank: train adapters of this rank on a frozen base (0: full fine-tuning; needs model.hf)", min=0
    )
    alpha: float = opt(0.0, "LoRA scale alpha (the update is alpha/r * B A; 0: twice r)", min=0.0)
    dropout: float = opt(0.0, "dropout on the adapters' input", min=0.0, max=0.99)
    targets: str = opt(
        "",
        "comma-separated module names to adapt, e.g. q_proj,v_proj (empty: the family's attention and MLP projections)",
    )
    base: Literal["fp32", "nf4"] = opt(
        "fp32", "how the frozen base is stored: fp32, or nf4 (QLoRA: 4-bit NormalFloat, torchao)"
    )


@dataclass(frozen=True)
class TrainJobConfig:
    """Everything ``shardwise train`` needs; one attribute per TOML table."""

    run: RunSection = field(default_factory=RunSection)
    # The built-in GPT's shape; the job fills in the vocabulary from the corpus.
    model: ModelSection = field(default_factory=ModelSection, metadata={"keys": MODEL_KEYS})
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    sample: SampleSection = field(default_factory=SampleSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    lora: LoraSection = field(default_factory=LoraSection)
