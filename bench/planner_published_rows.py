"""Published GPU training runs as planner inputs: one row of ``data/published_throughput.json`` ->
the model statistics, the cluster, the published layout as plan keys, how that framework runs the
step (:class:`~shardwise.plan.policy.RunPolicy`, :class:`~shardwise.plan.memory.StatePolicy`) and
the published throughput in tokens/s per GPU (each source's own FLOP formula, as its row notes say).

Everything here is read from the row's own fields and text (``gpu``, ``fsdp_or_zero``,
``recompute``, ``precision``, ``notes``), never from a table of runs: a held-out row of the same
format maps the same way.

Each row maps twice: ``cli_fixed`` is the published layout as ``shardwise plan --fixed`` keys with
nothing else set (shardwise's own runtime, its options searched; an FP8 run names
``precision=fp8``), the headline of the benchmark; ``fixed`` with ``run`` and ``policy`` is the
same layout under the way that row's framework ran it (the second column). A published selective
recomputation is another framework's policy (torchtitan's per-op or per-layer checkpointing,
Megatron-LM's attention-core recomputation), which keeps less or more than shardwise's
``recompute=selective`` (every matmul output), so the headline lets the planner choose shardwise's
selective or full recomputation there (``cli_recompute``), whichever fits; where the published policy
replays more than shardwise's selective (torchtitan's per-op and per-layer: :data:`REPLAYS_MORE`), the headline
prices that policy (``cli_selective``: ``shardwise plan --selective op|layer``), not a cheaper one the run did
not have. Context parallelism (``cp > 1``) is
``cp`` data-parallel ranks of sequence slices (:class:`~shardwise.plan.policy.RunPolicy` ``context_parallel``). A row
that the cost model cannot represent (an unknown GPU, an unknown metric) maps to a ``Skip`` with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from shardwise.errors import ConfigError
from shardwise.plan.cluster import PRESETS, ClusterSpec
from shardwise.plan.memory import StatePolicy
from shardwise.plan.policy import RunPolicy
from shardwise.plan.stats import ModelStats, transformer_stats
from shardwise.shape import TransformerShape

GB = 1e9
# Published selective policies that replay more than shardwise's own (every matmul output kept): torchtitan's
# per-op (every other matmul replayed) and per-layer (every second block), priced as they ran. Korthikanti et
# al.'s attention core replays about what shardwise's does (softmax and dropout against norms and activations).
REPLAYS_MORE = ("op", "layer")
H100_NVL_BF16 = 835e12  # NVIDIA H100 NVL datasheet: 1,671 TFLOP/s bf16 with sparsity, half of it dense


@dataclass(frozen=True)
class Case:
    index: int
    source: str  # the publication (rows of one paper / repository together)
    label: str  # model, GPUs, layout
    stats: ModelStats
    cluster: ClusterSpec
    global_batch: int
    fixed: str  # the published layout as plan keys (what it leaves out, the planner chooses)
    run: RunPolicy
    policy: StatePolicy
    precision: str
    published_tps: float  # tokens/s per GPU
    formula: str  # how the published metric became tokens/s per GPU
    setup: tuple[Any, ...]  # rows with the same model, GPUs and batch: the free search's comparison set
    cli_fixed: str = ""  # the layout as `shardwise plan --fixed` keys for shardwise's runtime (the headline)
    cli_recompute: tuple[str, ...] = ()  # recomputation levels the headline may choose ((): the one in cli_fixed)
    cli_selective: str = ""  # what the published selective recomputation kept (`shardwise plan --selective`), if any


@dataclass(frozen=True)
class Skip:
    index: int
    source: str
    label: str
    reason: str


def source_of(row: dict[str, Any]) -> str:
    """The publication: the source text before its first parenthesis or dash (one paper's tables,
    sections and abstract together; torchtitan's two tables together)."""
    text = str(row.get("source", "unknown"))
    return re.split(r"\s+[-(]|\s+Table\s|\s+Sec\.", text)[0].strip()


def year_of(row: dict[str, Any]) -> int | None:
    """The publication year the source text names (the earliest of its years), if any: software
    features (FlashAttention, sequence parallelism, overlapped gradient reduction in Megatron-LM)
    arrived in 2022-2023, so a run's year says which ones it could have used."""
    text = " ".join(str(row.get(k) or "") for k in ("source", "source_path_or_url"))
    years = [int(y) for y in re.findall(r"\b(20[12]\d)\b", text)]
    return min(years) if years else None


def _text(row: dict[str, Any]) -> str:
    return " ".join(
        str(row.get(k) or "") for k in ("source", "model", "precision", "fsdp_or_zero", "recompute", "notes", "gpu")
    )


# -- hardware -------------------------------------------------------------------------------------
def cluster_of(row: dict[str, Any]) -> ClusterSpec | str:
    """The preset for the row's GPU (with the memory its text names), or why there is none."""
    gpu = str(row.get("gpu") or "")
    low = gpu.lower()
    if "a800" in low:
        key = "a800"
    elif "a100" in low:
        key = "a100-40gb" if re.search(r"40\s*gb", low) else "a100-80gb"
    elif "h200" in low:
        key = "h200"
    elif "h800" in low:
        key = "h800"
    elif "h100" in low:
        key = "h100"
    elif "v100" in low:
        key = "v100"
    else:
        return f"no preset for GPU {gpu!r}"
    spec = PRESETS[key]
    gpus = int(row["gpus"])
    per_node = int(row.get("gpus_per_node") or min(8, gpus))
    spec = replace(spec, devices=gpus, devices_per_node=min(per_node, gpus))
    mem = re.findall(r"(\d+)\s*GB", gpu, flags=re.I)
    if mem and key not in ("a100-40gb", "a100-80gb") and 8 <= float(mem[-1]) <= 256:
        spec = replace(spec, memory_bytes=float(mem[-1]) * GB)
    if key == "h100" and "hbm2e" in low:  # Meta's H100 variant: 2.4 TB/s (torchao/testing/training/roofline_utils.py)
        spec = replace(spec, memory_bw=2.4e12)
    if key == "h100" and re.search(r"lower tdp|low tdp|limited tdp", low):
        # torchtitan's benchmarks ran on lower-TDP H100s whose "actual peak TFLOPs number is between
        # SXM and NVL" (docs/performance.md): the midpoint of the SXM's 989 and the NVL's 835 dense
        # bf16 TFLOP/s (NVIDIA H100 NVL datasheet), and the same share of the FP8 peak
        scale = (H100_NVL_BF16 + spec.peak("bf16")) / 2 / spec.peak("bf16")
        spec = replace(
            spec,
            peak_flops={
                k: v * scale if k in ("bf16", "fp16", "fp8", "tf32") else v for k, v in spec.peak_flops.items()
            },
        )
    return spec


# -- model ----------------------------------------------------------------------------------------
def stats_of(row: dict[str, Any], *, cp: int = 1) -> ModelStats:
    """The row's transformer, with the family's architecture read from its name and text: Llama
    (SwiGLU when ``ffn`` is not ``4 h``, rotary, no biases, separate q/k/v), MPT (no biases, tied,
    fused QKV), BLOOM (ALiBi, tied), Megatron's GPT (biases, learned positions, dropout). Attention
    is fused (FlashAttention / SDPA) unless the run predates it (Megatron-LM and DeepSpeed runs whose
    text does not mention flash attention)."""
    text = _text(row).lower()
    h, ffn = int(row["hidden"]), int(row.get("ffn") or 4 * int(row["hidden"]))
    heads, kv = int(row["heads"]), int(row.get("kv_heads") or row["heads"])
    name = str(row.get("model", "")).lower()
    gated = abs(ffn / h - 4.0) > 1e-6 and ffn < 4 * h
    llama_like = "llama" in name or kv < heads or gated
    year = year_of(row)
    old = year is None or year < 2023
    eager = ("flash" not in text) and any(k in text for k in ("megatron", "deepspeed", "bloom")) and old
    mpt = "mpt" in name
    bloom = "bloom" in name
    dropout = ("megatron" in text and "gpt" in name and eager) and not bloom
    shape = TransformerShape(
        layers=int(row["layers"]),
        hidden=h,
        heads=heads,
        vocab_size=int(row["vocab"]),
        seq_len=int(row["seq"]),
        ffn=ffn,
        kv_heads=kv if kv != heads else 0,
        dropout=0.1 if dropout else 0.0,
        tied_embeddings=mpt or bloom or ("megatron" in text and not llama_like),
        bias=not (llama_like or mpt),
        learned_positions=not (llama_like or bloom),
        attention="eager" if eager else "fused",
        separate_qkv=llama_like,
        name=str(row.get("model", "")),
    )
    s = int(row["seq"])
    if cp > 1:  # a sample is a 1/cp slice of a sequence, attending to all of it
        return transformer_stats(shape, seq=s // cp, context=s, gated_mlp=gated)
    return transformer_stats(shape, gated_mlp=gated)


# -- layout and runtime ---------------------------------------------------------------------------
def zero_of(row: dict[str, Any]) -> int:
    """The ZeRO stage the text names (an explicit ZeRO-N first, then FSDP's sharding strategies)."""
    text = str(row.get("fsdp_or_zero") or "").lower()
    named = re.search(r"zero[- ]?(?:stage[- ]?)?([123])", text)
    if named:
        return int(named.group(1))
    if re.search(r"shard_grad_op", text):
        return 2
    if re.search(r"full_shard|fsdp2|fully_shard|hybrid_shard|hsdp", text) or "fsdp" in text:
        return 3
    if re.search(r"stage-1|distributed optimizer", text):
        return 1
    return 0


def recompute_of(row: dict[str, Any]) -> tuple[str, str]:
    """(plan recompute, RunPolicy.selective)."""
    text = str(row.get("recompute") or "").lower()
    if text.startswith("selective") or "selective" in text:
        if "per-op" in text or "op" == text.split("(")[-1].strip(") "):
            return "selective", "op"
        if "per-layer" in text or "layer" in text:
            return "selective", "layer"
        return "selective", "attention"
    if "full" in text or "every block" in text:
        return "full", "attention"
    return "none", "attention"


def schedule_of(row: dict[str, Any]) -> dict[str, Any]:
    """Pipeline schedule keys when the text states them (else the planner chooses): interleaved
    (with its virtual stages when named), a plain 1F1B (``non-interleaved``, or ``1F1B`` named
    without ``interleaved``) or GPipe. A run that names its schedule ran that one: letting the
    planner take the interleaved schedule for a run that says 1F1B prices a smaller bubble than it had."""
    text = " ".join(str(row.get(k) or "") for k in ("notes", "recompute", "fsdp_or_zero", "precision")).lower()
    if "non-interleaved" in text or "non interleaved" in text:
        return {"schedule": "1f1b"}
    found = re.search(r"(\d+)\s*model chunks", text) or re.search(r"interleaved\s*m\s*=\s*(\d+)", text)
    if "interleaved" in text:
        return {"schedule": "interleaved_1f1b", **({"virtual_stages": int(found.group(1))} if found else {})}
    if re.search(r"\b1f1b\b", text):
        return {"schedule": "1f1b"}
    if "gpipe" in text:
        return {"schedule": "gpipe"}
    return {}


def published_tokens_per_gpu(row: dict[str, Any], stats: ModelStats, peak: float) -> tuple[float, str] | str:
    """The published figure as tokens/s per GPU, with the formula used (see the module doc)."""
    metric, value = str(row.get("published_metric")), float(row["published_value"])
    gpus, gb, s = int(row["gpus"]), int(row["global_batch"]), int(row["seq"])
    layers, h, v = int(row["layers"]), int(row["hidden"]), int(row["vocab"])
    notes = str(row.get("notes") or "")
    if metric == "tokens_per_s_per_gpu":
        return value, "published tokens/s per GPU"
    if metric in ("tokens_per_s", "tokens_per_s_total"):
        return value / gpus, "published tokens/s / GPUs"
    if metric == "samples_per_s":
        return value * s / gpus, "samples/s x seq / GPUs"
    if metric in ("iteration_time_s", "step_time_s"):
        return gb * s / (value * gpus), "global batch x seq / (iteration time x GPUs)"
    megatron_hw = 96.0 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))  # per token, full recompute counted
    megatron_model = (
        72.0 * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
    )  # Korthikanti app. A, no recompute
    six_n = 6.0 * stats.params_total + 12.0 * layers * h * s
    if metric == "hw_tflops_per_gpu_incl_recompute":
        return value * 1e12 / megatron_hw, "TFLOP/s / (96 l h^2 (1 + s/6h + V/16lh)) (Narayanan et al. 2021)"
    if metric in ("mfu_pct", "mfu"):
        frac = value / 100 if metric == "mfu_pct" else value
        if "Appendix-A" in notes or "72" in notes or "Korthikanti" in str(row.get("source")):
            return (
                frac * peak / megatron_model,
                "MFU x peak / (72 l h^2 (1 + s/6h + V/12lh)) (Korthikanti et al. 2022 app. A)",
            )
        return frac * peak / six_n, "MFU x peak / (6 N + 12 l h s)"
    if metric in ("model_tflops_per_gpu", "tflops_per_gpu"):
        return value * 1e12 / six_n, "TFLOP/s / (6 N + 12 l h s)"
    return f"unknown published metric {metric!r}"


def case_of(index: int, row: dict[str, Any]) -> Case | Skip:
    source = source_of(row)
    label = (
        f"{row.get('model')} {row.get('gpus')}x{row.get('gpu', '?')[:9]} dp{row.get('dp')} tp{row.get('tp')} "
        f"pp{row.get('pp')}"
    )
    cp = int(row.get("cp") or 1)
    cluster = cluster_of(row)
    if isinstance(cluster, str):
        return Skip(index, source, label, cluster)
    text = _text(row)
    low = text.lower()
    stats = stats_of(row, cp=cp)
    precision = (
        "fp16"
        if re.search(r"\bfp16\b", str(row.get("precision"))) and "bf16" not in str(row.get("precision"))
        else "bf16"
    )
    tps = published_tokens_per_gpu(row, stats, cluster.peak("bf16"))
    if isinstance(tps, str):
        return Skip(index, source, label, tps)
    tp, pp, dp = int(row.get("tp") or 1), int(row.get("pp") or 1), int(row.get("dp") or 1)
    if tp * pp * dp * cp != cluster.devices:
        return Skip(index, source, label, f"dp*tp*pp*cp={tp * pp * dp * cp} is not the {cluster.devices} GPUs")
    if cp > 1 and int(row["seq"]) % cp:
        return Skip(index, source, label, f"cp={cp} does not divide the sequence of {row['seq']}")
    dp *= cp  # the context-parallel ranks are data-parallel ranks of sequence slices (FSDP and gradients over both)
    zero = zero_of(row)
    recompute, selective = recompute_of(row)
    # Sequence parallelism where the text says so, and with torchtitan's TP (its TP plan shards the
    # norms' sequence; async TP needs it); Megatron-LM before 2022 and Korthikanti's baselines have none.
    denies_sp = bool(re.search(r"no sequence parallel|without sequence parallel", low))
    says_sp = "sequence parallel" in low and not denies_sp
    year = year_of(row)
    recent = year is not None and year >= 2023  # Megatron-LM, NeMo and torchtitan turn it on with TP
    sequence_parallel = tp > 1 and (says_sp or "torchtitan" in low or "async tp" in low or (recent and not denies_sp))
    keys: dict[str, Any] = {
        "tp": tp,
        "pp": pp,
        "zero": zero,
        "recompute": recompute,
        "sequence_parallel": sequence_parallel,
    }
    if zero and re.search(r"hybrid|hsdp", low):
        keys["shard"], keys["dp"] = (
            min(dp, cluster.devices_per_node // tp),
            dp // min(dp, cluster.devices_per_node // tp),
        )
    elif zero:
        keys["shard"], keys["dp"] = dp, 1
    else:
        keys["dp"] = dp
    gb = int(row["global_batch"]) * cp  # in slices of a sequence
    if pp > 1:
        keys.update(schedule_of(row))
    mb = row.get("micro_batch")
    if mb:
        per_replica = gb // dp
        m = max(1, round(per_replica / int(mb)))
        while per_replica % m:  # Composer splits a remainder into a smaller microbatch: the nearest even split
            m += 1
        keys["microbatches"] = m
    framework_old = (any(k in low for k in ("megatron", "deepspeed", "bloom")) and "fsdp" not in low
                     and (year is None or year < 2023) and "overlap-grad-reduce" not in low)
    fields = " ".join(str(row.get(k) or "") for k in ("precision", "fsdp_or_zero", "recompute")).lower()
    notes = str(row.get("notes") or "").lower()
    fp8 = bool(re.search(r"float8|fp8", str(row.get("precision") or "").lower()))
    async_tp = "async tp" in fields or bool(re.search(r"optimizations?( column)?:[^.]*async tp", notes))
    run = RunPolicy.sixteen_bit(
        selective=selective,
        grad_reduce_overlap=not framework_old,
        linear_dtype="fp8" if fp8 else "",
        async_tp=async_tp,
        zero3_unit="linear" if "deepspeed" in low and zero == 3 else "block",
        context_parallel=cp,
        sp_saves_shard="megatron" in low,
        fused_grad_accumulation="megatron" in low and year is not None and year >= 2022,
    )
    policy = (
        StatePolicy.torch("bf16", reduce_bytes=2.0 if "pure" in low else 4.0)
        if zero >= 2 or "fsdp" in low
        else StatePolicy.megatron()
    )
    fixed = ",".join(f"{k}={str(v).lower()}" for k, v in keys.items())
    cli = dict(keys)
    cli_recompute: tuple[str, ...] = ()
    if recompute == "selective":  # another framework's selective policy (see the module doc)
        del cli["recompute"]
        cli_recompute = ("selective", "full")
    if re.search(r"compile\s*=\s*true|torch\.compile\b(?! limitations)", low):  # the run compiled its blocks
        cli["compile"] = True
    if fp8:
        cli["precision"] = "fp8"
        if "rowwise" in low:
            cli["fp8_recipe"] = "rowwise"
    cli_fixed = ",".join(f"{k}={str(v).lower()}" for k, v in cli.items())
    setup = (stats.name, int(row["seq"]), str(row.get("gpu")), cluster.devices, gb)
    label = f"{row.get('model')} s{row['seq']} {cluster.devices}x{cluster.name} {fixed}"
    return Case(
        index=index,
        source=source,
        label=label,
        stats=stats,
        cluster=cluster,
        global_batch=gb,
        fixed=fixed,
        run=run,
        policy=policy,
        precision=precision,
        published_tps=tps[0],
        formula=tps[1],
        setup=setup,
        cli_fixed=cli_fixed,
        cli_recompute=cli_recompute,
        cli_selective=selective if recompute == "selective" and selective in REPLAYS_MORE else "",
    )



def cases(rows: list[dict[str, Any]]) -> list[Case | Skip]:
    """Every row as a case, or a Skip naming why it cannot be one (a malformed or unmodelled row of
    a held-out file must not stop the others)."""
    out: list[Case | Skip] = []
    for i, row in enumerate(rows):
        try:
            out.append(case_of(i, row))
        except (ConfigError, KeyError, TypeError, ValueError) as exc:
            out.append(
                Skip(
                    i,
                    source_of(row) if isinstance(row, dict) else "unknown",
                    str(row.get("model", "?")) if isinstance(row, dict) else "?",
                    f"cannot map the row: {exc}",
                )
            )
    return out


__all__ = ["Case", "Skip", "case_of", "cases", "cluster_of", "published_tokens_per_gpu", "source_of", "stats_of"]
