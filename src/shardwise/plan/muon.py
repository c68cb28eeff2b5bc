"""What Muon (``shardwise.optim.Muon``) costs a plan, beside AdamW: torch-free, like the planner.

The hidden matrices of a transformer block (q, k, v, o: ``h x h``, k/v ``h_kv x h`` under
grouped-query attention; the MLP's 2 or 3 ``f x h`` matrices, ``f`` from the block's parameters, to a multiple of 8)
take Muon; embeddings, head, norms and biases take AdamW. Per rank and step:

- **state**: one fp32 momentum per Muon value (4 bytes), Adam's two moments (8) per AdamW value:
  :func:`state_bytes_per_param` blends them into the policy's ``K``; sharded as the plan shards
  the parameters (ZeRO-2/3, TP; ZeRO-1 does not partition Muon's state in shardwise).
- **Newton–Schulz FLOPs**: ``steps (4 m² n + 2 m³)`` per ``m x n`` matrix (``m <= n``). With owner
  ranks (a 1-D sharding: ZeRO-2/3 alone or TP alone) each of the ``N`` ranks runs ~1/N of the
  stage's matrices; with replicated parameters (dp, ZeRO-1) or a 2-D sharding (FSDP x TP, HSDP:
  the gather path) every rank runs all of them.
- **bytes sent**: owner path: two all-to-alls, ``2 (N-1)/N² · B``; gather path: one all-gather,
  ``(N-1)/N · B``, where ``B`` is the stage's Muon values in the Newton–Schulz dtype.
- **owner buffers** (transient, during the step): the owned whole matrices and the send/receive
  buffers (``3 B/N``), plus one matrix's Newton–Schulz workspace (``m n + 3 m²`` values).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.stats import ModelStats

NS_STEPS = 5


@dataclass(frozen=True)
class MuonCost:
    """Per rank and step (module doc); ``ns_seconds`` at the cluster's achievable matmul rate."""

    muon_params: float  # of the whole model
    adamw_params: float
    state_bytes: float
    ns_flops: float
    ns_seconds: float
    comm_bytes: float
    buffer_bytes: float
    path: str  # "owner", "gather" or "local"

    def to_json(self) -> dict[str, float | str]:
        return asdict(self)

    def line(self) -> str:
        return (
            f"Muon ({self.path}): state {self.state_bytes / 1e9:.3g} GB, Newton-Schulz {self.ns_flops / 1e9:.3g} GFLOP "
            f"({self.ns_seconds * 1e3:.3g} ms), {self.comm_bytes / 1e6:.3g} MB sent, "
            f"buffers {self.buffer_bytes / 1e6:.3g} MB per rank and step"
        )


def block_matrices(stats: ModelStats) -> list[tuple[int, int]]:
    """The Muon matrices of one block, ``(m, n)`` with ``m <= n`` (module doc)."""
    h = stats.hidden
    if h <= 0 or stats.heads <= 0:
        raise ConfigError(
            f"the planner cannot price Muon for {stats.name}: its hidden size is unknown",
            hint="give the model as --model-spec or --model.hf, or plan with --optimizer adamw",
        )
    kv = stats.kv_hidden or h
    attn = [(h, h), (kv, h), (kv, h), (h, h)]
    rest = stats.params_per_block - stats.replicated_per_block - 2 * h * h - 2 * kv * h
    mlp = 3 if stats.gated_mlp else 2  # (an MoE block's experts count as one wide MLP: FLOPs are then a bound)
    f = max(8, 8 * round(rest / (mlp * h) / 8))  # biases and norms left out: to a multiple of 8
    return [(min(a, b), max(a, b)) for a, b in attn] + [(min(f, h), max(f, h))] * mlp


def state_bytes_per_param(stats: ModelStats) -> float:
    """Muon's 4 bytes on its matrices and AdamW's 8 on the rest, per parameter of the model."""
    muon = stats.blocks * sum(m * n for m, n in block_matrices(stats))
    return (4.0 * muon + 8.0 * (stats.params_total - muon)) / stats.params_total


def _path(plan: Plan) -> tuple[str, int]:
    sharded = plan.zero >= 2 and plan.shard > 1
    if sharded and plan.tp > 1 or plan.hsdp_enabled:
        return "gather", plan.shard * plan.tp
    if sharded or plan.tp > 1:
        return "owner", plan.shard if sharded else plan.tp
    return "local", 1


def muon_cost(
    stats: ModelStats, plan: Plan, cluster: ClusterSpec, *, ns_bytes: int = 2, steps: int = NS_STEPS
) -> MuonCost:
    """Muon's terms for ``plan`` (module doc); ``ns_bytes`` 2 for bf16 Newton–Schulz, 4 for fp32."""
    mats = block_matrices(stats)
    per_block = sum(m * n for m, n in mats)
    stage_blocks = -(-stats.blocks // plan.pp)
    values = stage_blocks * per_block
    flops = stage_blocks * sum(steps * (4 * m * m * n + 2 * m**3) for m, n in mats)
    path, n = _path(plan)
    shards = (plan.shard if plan.zero >= 2 else 1) * plan.tp
    b = values * ns_bytes
    comm = 2 * (n - 1) / n**2 * b if path == "owner" else (n - 1) / n * b if path == "gather" else 0.0
    m, k = max(mats, key=lambda mn: mn[0] * mn[1])
    buffers = (3 * b / n if path == "owner" else b / shards if path == "gather" else 0.0) + (
        m * k + 3 * m * m
    ) * ns_bytes
    rate = (
        cluster.peak_flops.get("bf16" if ns_bytes == 2 else "fp32", max(cluster.peak_flops.values()))
        * cluster.achievable_fraction
    )
    total_muon = stats.blocks * per_block
    state = (4.0 * values + 8.0 * (stats.params_total / plan.pp - values)) / shards
    return MuonCost(
        muon_params=total_muon,
        adamw_params=stats.params_total - total_muon,
        state_bytes=state,
        ns_flops=flops / (n if path == "owner" else 1),
        ns_seconds=flops / (n if path == "owner" else 1) / rate,
        comm_bytes=comm,
        buffer_bytes=buffers,
        path=path,
    )
