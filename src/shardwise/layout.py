"""The parallel layout as one validated value: :class:`Plan` (a leaf: it imports nothing of shardwise
but its errors and the fill-in rules of its degrees (:mod:`shardwise.degrees`), so every layer may import
it, like torchtitan's ``ParallelDims``).

A plan names five degrees whose product is the world size, laid out on a named device mesh from
the outermost to the innermost dimension (innermost = fastest links, so TP stays inside a node)::

    ("pp", "dp_replicate", "dp_shard", "cp", "tp")

- ``dp``: replicas that each hold a full copy of the (possibly sharded) model state: DDP, or the
  replicate dimension of HSDP;
- ``shard``: the ZeRO / FSDP sharding degree (``zero`` 1: optimizer state, 2: + gradients,
  3: + parameters). ``zero=0`` means no sharding and requires ``shard == 1``;
- ``cp``: context parallel degree: each sample's sequence is cut into ``2 cp`` chunks and rank
  ``r`` of the ``cp`` group keeps chunks ``r`` and ``2 cp - 1 - r`` (zig-zag: equal causal work);
- ``tp``: tensor (and sequence) parallel degree;
- ``pp``: pipeline stages, with ``schedule``, ``microbatches`` and ``virtual_stages`` per rank;
- ``ep``: expert parallel degree: the experts of each MoE layer are split over ``ep`` of the
  data-parallel ranks (it adds no processes: ``ep`` divides the innermost data-parallel degree in
  use, ``shard`` with ZeRO, else ``dp``), tokens travel to their experts by all-to-all.

Data-parallel size (how many different batches are processed per step) is ``dp * shard``; the
ranks that see different tokens (and reduce gradients together) are ``dp * shard * cp``.

Strings: ``Plan.parse("dp=2,tp=2")``, ``"zero=3,shard=4"``, ``"pp=2,schedule=1f1b,microbatches=8"``.
For convenience ``"zero=3,dp=4"`` means *shard over the 4 data-parallel ranks* (``shard=4``); HSDP
is spelled with both degrees: ``"zero=3,dp=2,shard=2"``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any, Literal

from shardwise.degrees import default_microbatches, fill_degrees, fill_expert_ranks, suggest_degrees
from shardwise.errors import ConfigError

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
Recompute = Literal["none", "selective", "full"]
Precision = Literal["fp32", "bf16", "fp16", "fp8"]
Fp8Recipe = Literal["tensorwise", "rowwise"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FP8_RECIPES = ("tensorwise", "rowwise")
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

_ALIASES = {
    "zero_stage": "zero",
    "fsdp": "shard",
    "dp_shard": "shard",
    "dp_replicate": "dp",
    "mb": "microbatches",
    "num_microbatches": "microbatches",
    "vpp": "virtual_stages",
    "sp": "sequence_parallel",
    "ac": "recompute",
    "activation_checkpointing": "recompute",
    "context_parallel": "cp",
    "expert_parallel": "ep",
    "sharded_accum": "sharded_accumulation",
    "fused_loss": "chunked_loss",
}


@dataclass(frozen=True)
class Plan:
    """How one training job is spread over its processes (see the module doc)."""

    dp: int = 1
    shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    schedule: Schedule = "1f1b"
    microbatches: int = 0  # 0: one per pipeline stage and virtual stage (1 without a pipeline)
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: Recompute = "none"
    precision: Precision = "fp32"
    cpu_offload: bool = False
    compile: bool = False
    # Runtime options that change memory and time but not the math (the planner models each one):
    params16: bool = False  # 16-bit parameters for compute (FSDP2 param_dtype), fp32 masters and reductions
    chunked_loss: bool = False  # LM head + cross-entropy per chunk of tokens: full logits never held
    sharded_accumulation: bool = False  # ZeRO-2/3: reduce-scatter after every micro-batch
    fp8_recipe: Fp8Recipe = "tensorwise"  # with precision="fp8": torchao float8 scaling

    def __post_init__(self) -> None:
        if self.microbatches == 0 and isinstance(self.pp, int) and isinstance(self.virtual_stages, int):
            object.__setattr__(self, "microbatches", default_microbatches(self.pp, self.virtual_stages))
        for name in ("dp", "shard", "tp", "pp", "cp", "ep", "microbatches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"plan {name}={value!r} must be a positive integer", hint=f"for example {name}=1")
        if self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"plan zero={self.zero!r} is not a ZeRO stage", hint="use 0 (off), 1, 2 or 3")
        if self.zero == 0 and self.shard > 1:
            raise ConfigError(
                f"plan shard={self.shard} needs a ZeRO stage", hint=f"add zero=3 (or 1, 2), or use dp={self.shard}"
            )
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"plan schedule={self.schedule!r} is unknown", hint=f"use one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(
                f"plan recompute={self.recompute!r} is unknown", hint=f"use one of {', '.join(RECOMPUTE)}"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"plan precision={self.precision!r} is unknown", hint=f"use one of {', '.join(PRECISIONS)}"
            )
        if self.fp8_recipe not in FP8_RECIPES:
            raise ConfigError(
                f"plan fp8_recipe={self.fp8_recipe!r} is unknown", hint=f"use one of {', '.join(FP8_RECIPES)}"
            )
        if self.params16 and self.precision == "fp32":
            raise ConfigError(
                "plan params16 needs a 16-bit precision", hint="add precision=bf16 (or fp16, fp8), or drop params16"
            )
        if self.sharded_accumulation and self.zero < 2:
            raise ConfigError(f"plan sharded_accumulation needs sharded gradients (zero=2 or 3), not zero={self.zero}",
                              hint="add zero=3 (or 2), or drop sharded_accumulation")
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise ConfigError(
                f"plan virtual_stages={self.virtual_stages} needs the interleaved schedule",
                hint="add schedule=interleaved_1f1b, or use virtual_stages=1",
            )
        if self.ep > 1 and (self.shard if self.zero > 0 else self.dp) % self.ep:
            inner = "shard" if self.zero > 0 else "dp"
            raise ConfigError(
                f"plan ep={self.ep} does not divide {inner}={self.shard if self.zero > 0 else self.dp}: "
                "experts are split over data-parallel ranks",
                hint=f"use an ep that divides {inner}, or more data-parallel ranks (e.g. {inner}={self.ep})",
            )
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError(
                "plan sequence_parallel needs tp > 1", hint="add tp=2 (or more), or drop sequence_parallel"
            )
        if self.pp > 1 and self.microbatches < self.pp and self.schedule != "gpipe":
            raise ConfigError(
                f"plan microbatches={self.microbatches} is fewer than pp={self.pp} stages for schedule {self.schedule}",
                hint=f"use microbatches>={self.pp} (e.g. {2 * self.pp}) or schedule=gpipe",
            )

    # -- derived ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.shard * self.cp * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        """Data-parallel size: how many different batches one step processes."""
        return self.dp * self.shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.zero > 0

    @property
    def hsdp_enabled(self) -> bool:
        return self.zero > 0 and self.dp > 1 and self.shard > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def token_parallel_size(self) -> int:
        """Ranks that see different tokens and reduce gradients together: ``dp * shard * cp``."""
        return self.dp * self.shard * self.cp

    @property
    def mesh_shape(self) -> tuple[int, int, int, int, int]:
        """Sizes of ``MESH_DIMS`` = ("pp", "dp_replicate", "dp_shard", "cp", "tp")."""
        return (self.pp, self.dp, self.shard, self.cp, self.tp)

    # -- checks ----------------------------------------------------------------------------
    def check_world(self, world_size: int) -> Plan:
        """Raise unless the degrees multiply to ``world_size``; return self for chaining."""
        if self.world_size != world_size:
            raise ConfigError(
                f"plan {self} uses {self.world_size} processes (dp*shard*cp*tp*pp) but the world has {world_size}",
                hint=f"try {suggest_degrees(world_size)}",
            )
        return self

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, *, world_size: int | None = None) -> Plan:
        """``"dp=2,tp=2"`` -> Plan(dp=2, tp=2). Flags without a value mean True (``sp``). With
        ``world_size`` the degrees left out are filled in (see :meth:`from_dict`)."""
        text = text.strip()
        if text in ("", "single", "none"):
            return cls(dp=world_size or 1)
        return cls.from_dict(named_keys(text), world_size=world_size)

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, world_size: int | None = None) -> Plan:
        """A plan from the keys a user named; with ``world_size`` the rest is filled in:

        - ``zero=N`` with ``dp`` but no ``shard``: shard over those data-parallel ranks (``"zero=3,dp=4"``);
        - ``zero=N`` with neither: shard over all data-parallel ranks, the rest of the world after tp and pp;
        - ``zero=N`` with ``shard`` but no ``dp``: ``dp`` replicas of the shard group (HSDP) fill the rest;
        - no ZeRO and no ``dp``: ``dp`` takes the rest of the world;
        - ``ep=N`` names no degree of its own (experts split over the data-parallel ranks): with
          ``world_size`` data parallelism fills the rest as above; without one, the data-parallel
          ranks it needs (``dp=N``, or ``shard=N`` under ZeRO) are filled in, as ``tp=N`` alone
          means a world of N;
        - ``pp`` without ``microbatches``: one microbatch per stage and virtual stage (the planner
          chooses instead where it has the model: ``shardwise plan --fixed``).
        """
        out = _normalized(values)
        if world_size is not None:
            out = fill_degrees(out, world_size)
        else:
            out = fill_expert_ranks(out)
        return cls(**out)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps({"shardwise_plan": 1, **self.to_dict()}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"plan file is not JSON ({exc.msg} at line {exc.lineno})", hint="write it with Plan.save"
            ) from None
        data.pop("shardwise_plan", None)
        return cls.from_dict(data)

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            fh.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> Plan:
        with open(path) as fh:
            return cls.from_json(fh.read())

    # -- display ---------------------------------------------------------------------------
    def __str__(self) -> str:
        parts = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default or f.name in ("dp",):
                if f.name == "schedule" and not self.pp_enabled:
                    continue
                if f.name == "fp8_recipe" and self.precision != "fp8":
                    continue
                if f.name == "microbatches" and value == default_microbatches(self.pp, self.virtual_stages):
                    continue
                parts.append(f.name if value is True else f"{f.name}={value}")
        return ",".join(parts)

    def describe(self) -> str:
        """A readable table: degrees, mesh, and what each technique does here."""
        dp_mode = "HSDP" if self.hsdp_enabled else "FSDP" if self.fsdp_enabled else "DDP" if self.dp_enabled else "off"
        rows = [
            ("world size", str(self.world_size)),
            ("mesh (pp, dp_replicate, dp_shard, cp, tp)", str(self.mesh_shape)),
            (
                "data parallel",
                f"{self.dp_size} ({dp_mode})",
            ),
            (
                "ZeRO stage",
                f"{self.zero}"
                + (
                    {1: " (optimizer state sharded)", 2: " (+ gradients)", 3: " (+ parameters)"}.get(
                        self.zero, " (off)"
                    )
                ),
            ),
            (
                "context parallel",
                f"{self.cp}" + (f" (each sequence in {2 * self.cp} zig-zag chunks)" if self.cp_enabled else ""),
            ),
            ("tensor parallel", f"{self.tp}" + (" + sequence parallel" if self.sequence_parallel else "")),
            (
                "pipeline parallel",
                f"{self.pp}"
                + (
                    f", {self.schedule}, {self.microbatches} microbatches"
                    + (f", {self.virtual_stages} virtual stages" if self.virtual_stages > 1 else "")
                    if self.pp_enabled
                    else ""
                ),
            ),
            (
                "expert parallel",
                f"{self.ep}" + (" (experts split over data-parallel ranks)" if self.ep_enabled else ""),
            ),
            ("activation recompute", self.recompute),
            (
                "precision",
                self.precision + (" (fp32 master weights and reductions)" if self.precision != "fp32" else ""),
            ),
        ]
        if self.precision == "fp8":
            rows.append(("fp8 recipe", f"{self.fp8_recipe} (torchao float8 linear layers)"))
        if self.params16:
            rows.append(("parameter storage", "16-bit for compute, fp32 sharded masters"))
        if self.chunked_loss:
            rows.append(("loss", "LM head + cross-entropy chunked over tokens"))
        if self.sharded_accumulation:
            rows.append(("gradient accumulation", "into shards (reduce-scatter every micro-batch)"))
        if self.cpu_offload:
            rows.append(("cpu offload", "parameters and optimizer state"))
        if self.compile:
            rows.append(("torch.compile", "on"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def named_keys(text: str) -> dict[str, Any]:
    """The keys a plan string names, with their aliases resolved and values typed, and
    ``"zero=N,dp=D"`` read as ``shard=D`` (the fill-in rules of :meth:`Plan.from_dict`; what
    ``shardwise plan --fixed`` fixes while it searches the rest)."""
    values: dict[str, Any] = {}
    for item in text.strip().split(","):
        if not item.strip():
            continue
        key, sep, raw = item.strip().partition("=")
        key = _ALIASES.get(key.strip().lower(), key.strip().lower())
        values[key] = raw.strip() if sep else "true"
    return _normalized(values)


def _normalized(values: dict[str, Any]) -> dict[str, Any]:
    known = {f.name: f for f in fields(Plan)}
    out: dict[str, Any] = {}
    for key, raw in values.items():
        key = _ALIASES.get(key, key)
        if key not in known:
            raise ConfigError(f"unknown plan key {key!r}", hint=f"valid keys: {', '.join(known)}")
        out[key] = _coerce(key, raw, known[key].type)
    # "zero=3,dp=4" means: shard over the data-parallel ranks (the common case).
    if isinstance(out.get("zero", 0), int) and out.get("zero", 0) > 0 and "shard" not in out and "dp" in out:
        out["shard"], out["dp"] = out["dp"], 1
    return out


def _coerce(key: str, raw: Any, annotation: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    kind = str(annotation)
    if kind in ("int", "<class 'int'>"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"plan {key}={raw!r} is not an integer", hint=f"for example {key}=2") from None
    if kind in ("bool", "<class 'bool'>"):
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"plan {key}={raw!r} is not a boolean", hint=f"use {key}=true or {key}=false")
    return raw.lower()
