"""Search the plans of a world size and rank them by predicted step time.

Enumeration, outermost first, with the pruning that keeps a 1,024-device search well under a second:

1. ``tp``: divides the world, stays inside a node (``tp | devices_per_node``: TP's per-layer
   all-reduces need the fastest links) and divides heads, hidden, FFN and KV heads;
2. ``pp``: divides what is left and is at most the number of blocks;
3. data-parallel size ``D = world / (tp pp)`` must divide the global batch;
4. ZeRO stage and layout: DDP (stage 0), or stage 1-3 sharded over all ``D`` ranks (FSDP) or over a
   node's worth with replicas across nodes (HSDP). Only layouts the parallel layer runs
   (:func:`shardwise.plan.support.runtime_conflict`): ZeRO-1 is ``ZeroRedundancyOptimizer`` over DDP, so it is
   offered without tp and pp only; with tp or pp the sharded stages are 2-3 (FSDP2, which the cost
   model charges a gather per microbatch under pipelining). A layout whose *model states alone*
   overflow the device is dropped before any microbatch or schedule is tried;
5. microbatch count ``m`` (every divisor of the per-replica batch, without a cap unless
   ``SearchOptions.max_microbatches`` sets one; ``m >= pp`` except for GPipe), schedule (GPipe,
   1F1B, interleaved 1F1B with 2, 3 or 4 virtual stages where ``pp v`` chunks of at least one
   block exist (the runtime's balanced cuts, uneven where ``pp v`` does not divide the blocks) and
   ``m`` is a multiple of ``pp``, as Megatron-LM requires);
6. recomputation ``none`` -> ``selective`` -> ``full``: the first that fits wins, because more
   recomputation is never faster;
7. inside each recomputation level, shardwise's runtime options (``params16``, ``chunked_loss``,
   ``sharded_accumulation``; :mod:`shardwise.plan.options`) in their order of preference: the first
   combination that fits wins; one that costs step time (sharded accumulation) lets the next
   recomputation level be priced too, which may be faster. With ``SearchOptions.options_for_memory``
   (``shardwise plan --runtime-options memory``) every option is tried off first: one is on only
   where the plan does not fit without it.

Every plan's predicted speed is bounded by the cost model's validated envelope
(:func:`shardwise.plan.uncertainty.bounded`: no faster than the best MFU a published run of its
chip measured, plus 5%; ``SearchOptions.envelope`` gives another table, e.g. the cross-validation's,
made without the source it predicts).

``SearchOptions.precisions`` searches several compute precisions (``plan="auto"`` on a device
with FP8 tensor cores: bf16 and fp8), each plan with its own.

Sequence parallelism is switched on whenever ``tp > 1`` (same communication volume as plain TP,
less activation memory; Korthikanti et al. 2022).

``SearchOptions.fixed`` (``shardwise plan --fixed dp=24,tp=8,pp=8``) fixes only the keys it names
and searches the others: a named ``dp`` without ``zero`` or ``shard`` fixes the data-parallel size
(DDP, ZeRO or HSDP over it), ``zero=N,dp=D`` means ``shard=D`` (the plan strings' fill-in rule), and
every other named key (``tp, pp, zero, shard, microbatches, schedule, virtual_stages, recompute,
sequence_parallel, precision, fp8_recipe`` and the runtime options) must equal its value; the
runtime options a user does not name are searched (``--fixed dp=24,tp=8,pp=8`` may turn on the
chunked loss or sharded accumulation to make that layout fit).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from shardwise.errors import ConfigError
from shardwise.layout import Plan, named_keys
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.cost import Estimate, StatePolicy, estimate, model_state_bytes, stage_param_count
from shardwise.plan.explain import explain
from shardwise.plan.options import costs_time, option_notes, option_sets
from shardwise.plan.search_space import (
    SearchOptions,
    _cp_choices,
    _layouts,
    _matches,
    _schedules,
    _with_experts,
    divisors,
)
from shardwise.plan.stats import ModelStats
from shardwise.plan.support import runtime_conflict
from shardwise.plan.uncertainty import bounded

PASSED_THROUGH = ("compile", "cpu_offload", "fp8_recipe")  # plan keys the search never varies: a --fixed value is kept


@dataclass(frozen=True)
class SearchResult:
    plans: list[Estimate]  # fitting plans, fastest first (at most options.top)
    evaluated: int
    explanation: str = ""
    smallest: Estimate | None = None  # the least-memory plan, when none fits
    min_devices: int | None = None  # the smallest device count that would fit, when none fits
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Estimate:
        if not self.plans:
            raise self.no_fit_error()
        return self.plans[0]

    def no_fit_error(self) -> ConfigError:
        if self.smallest is None:
            return ConfigError(
                f"no valid layout: after {self.evaluated} candidates none factors the world size with a data-parallel "
                "degree that divides the global batch",
                hint="use a global batch that is a multiple of the device count",
            )
        need = self.smallest.memory_total if self.smallest else float("nan")
        limit = self.smallest.memory_limit if self.smallest else float("nan")
        where = (
            f"the smallest device count that fits is {self.min_devices}"
            if self.min_devices
            else "no device count up to 2^20 fits this batch"
        )
        layout = f" ({self.smallest.plan})" if self.smallest else ""
        return ConfigError(
            f"no plan fits: the least memory any layout needs is {need / 1e9:.2f} GB per device{layout}, "
            f"above the {limit / 1e9:.2f} GB usable",
            hint=f"{where}; or use devices with more memory, a smaller global batch or a smaller model",
        )


def search(
    stats: ModelStats, cluster: ClusterSpec, *, global_batch: int, options: SearchOptions | None = None
) -> SearchResult:
    """Rank every valid plan for ``cluster.devices`` processes (see the module doc)."""
    options = options or SearchOptions()
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch={global_batch!r} must be a positive integer", hint="e.g. --global-batch 64")
    fitting, evaluated = [], 0
    for precision in options.precisions or (options.precision,):
        opts = options if precision == options.precision else replace(options, precision=precision)
        found, count = _enumerate(stats, cluster, global_batch, opts)
        fitting += found
        evaluated += count
    if not fitting and "cp" not in options.fixed and _cp_choices(stats, cluster.devices):
        # A sequence that fits on no layout without context parallelism: split it over cp ranks.
        fitting, more = _enumerate(stats, cluster, global_batch, replace(options, context_parallel=True))
        evaluated += more
    fitting.sort(key=lambda e: (e.step_time_s, e.memory_total))
    top = fitting[: max(1, options.top)]
    if top:
        text = explain(top[0], top[1]) if len(top) > 1 else f"{top[0].plan} is the only plan that fits."
        notes = option_notes(
            top[0],
            lambda plan: evaluate(stats, cluster, plan, global_batch=global_batch, options=options),
        )
        if notes:
            text += " Runtime options: " + "; ".join(notes) + "."
        return SearchResult(plans=top, evaluated=evaluated, explanation=text, notes=notes)
    smallest = _least_memory(stats, cluster, global_batch, options)
    return SearchResult(
        plans=[],
        evaluated=evaluated,
        smallest=smallest,
        min_devices=_min_devices(stats, cluster, global_batch, options),
    )


__all__ = ["SearchOptions", "SearchResult", "candidates", "divisors", "evaluate", "explain", "fixed_options", "search"]


def evaluate(
    stats: ModelStats, cluster: ClusterSpec, plan: Plan, *, global_batch: int, options: SearchOptions | None = None
) -> Estimate:
    """The estimate of one given plan (``shardwise plan --fixed``), checked against the world and model."""
    options = options or SearchOptions()
    plan.check_world(cluster.devices)
    if plan.tp > 1:
        bad = [d for d in stats.tp_divides if d % plan.tp]
        if bad or not stats.tp_divides:
            raise ConfigError(
                f"plan tp={plan.tp} does not divide the model's heads/hidden sizes {stats.tp_divides}",
                hint="use a tp that divides the number of heads",
            )
    return estimate(
        stats,
        cluster,
        plan,
        global_batch=global_batch,
        policy=options.policy,
        headroom=options.headroom,
        run=options.run,
    )


def candidates(stats: ModelStats, cluster: ClusterSpec, *, global_batch: int, options: SearchOptions) -> list[Estimate]:
    """Every plan the options allow, fitting or not, fastest first (no pruning by memory): what a
    fixed layout that does not fit would cost, e.g. a published run the model says overflows."""
    every, _ = _enumerate(stats, cluster, global_batch, options, keep_all=True)
    return sorted(every, key=lambda e: (e.step_time_s, e.memory_total))


def fixed_options(text: str, options: SearchOptions) -> SearchOptions:
    """``options`` restricted to the keys ``text`` names (``shardwise plan --fixed``)."""
    keys = named_keys(text)
    extra: dict[str, Any] = {"fixed": keys}
    if "precision" in keys:
        extra["precision"] = keys["precision"]
    if "recompute" in keys:
        extra["recompute"] = (keys["recompute"],)
    if "zero" in keys:
        extra["zero_stages"] = (keys["zero"],)
    if "schedule" in keys:
        extra["schedules"] = (keys["schedule"],)
    if "sequence_parallel" in keys:
        extra["sequence_parallel"] = bool(keys["sequence_parallel"])
    if "precision" in keys:
        extra["precisions"] = ()
    return replace(options, **extra)


def _price_options(
    stats: ModelStats,
    cluster: ClusterSpec,
    global_batch: int,
    options: SearchOptions,
    *,
    keep_all: bool,
    lean: bool,
    layout: dict[str, Any],
) -> tuple[list[Estimate], int, bool]:
    """Price one layout under the runtime options in their order of preference (step 7 of the
    module doc): (estimates kept, estimates made, whether more recomputation is pointless). The
    preferred combination is priced first, then the leanest: when neither fits, nothing between
    them does, so a layout that does not fit costs at most two estimates per recomputation level."""
    fixed = options.fixed
    sets = option_sets(
        precision=layout["precision"],
        zero=layout["zero"],
        shard=layout["shard"],
        microbatches=layout["microbatches"],
        has_logits=stats.logits_bytes > 0,
        device_type=cluster.device_type,
        allowed=options.runtime_options,
        fixed=fixed,
        for_memory=options.options_for_memory,
    )
    leanest = max(sets, key=lambda o: sum(o.values()))  # every option on: each one only lowers the memory
    count = [0]

    def price(runtime: dict[str, bool]) -> Estimate | None:
        try:
            plan = Plan(**layout, **runtime, **{k: fixed[k] for k in PASSED_THROUGH if k in fixed})
        except ConfigError:
            return None
        if (fixed and not _matches(plan, fixed)) or (runtime_conflict(plan) is not None and not fixed):
            return None
        if options.supported is not None and not options.supported(plan):
            return None
        count[0] += 1
        return bounded(
            estimate(
                stats,
                cluster,
                plan,
                global_batch=global_batch,
                policy=options.policy,
                headroom=options.headroom,
                run=options.run,
            ),
            cluster,
            options.envelope,
        )

    if lean:  # the leanest combination the runtime accepts (``supported`` may refuse an option)
        for runtime in sorted(sets, key=lambda o: -sum(o.values())):
            est = price(runtime)
            if est is not None:
                return [est], count[0], False
        return [], count[0], False
    if keep_all:
        return [e for e in map(price, sets) if e is not None], count[0], False
    first = price(sets[0])
    if first is not None and first.fits:
        return [first], count[0], not costs_time(sets[0])
    lean_est = price(leanest) if leanest is not sets[0] else first
    if lean_est is not None and not lean_est.fits:
        return [], count[0], False
    for runtime in sets[1:]:
        est = lean_est if runtime is leanest else price(runtime)
        if est is not None and est.fits:
            return [est], count[0], not costs_time(runtime)
    return [], count[0], False


def _enumerate(
    stats: ModelStats,
    cluster: ClusterSpec,
    global_batch: int,
    options: SearchOptions,
    *,
    keep_all: bool = False,
    lean: bool = False,
) -> tuple[list[Estimate], int]:
    world, per_node = cluster.devices, cluster.devices_per_node
    limit = cluster.memory_bytes * (1 - options.headroom)
    policy = options.policy or StatePolicy.torch(options.precision)
    fixed = options.fixed
    out: list[Estimate] = []
    evaluated = 0
    for tp in divisors(world):
        if "tp" in fixed and tp != fixed["tp"]:
            continue
        if (
            tp > 1
            and (per_node % tp or not stats.tp_divides or any(d % tp for d in stats.tp_divides))
            and "tp" not in fixed
        ):
            continue
        cps = (
            [fixed["cp"]]
            if "cp" in fixed
            else [1] + (_cp_choices(stats, world // tp) if options.context_parallel else [])
        )
        for cp, pp in [(c, p) for c in cps if (world // tp) % c == 0 for p in divisors(world // (tp * c))]:
            if pp > stats.blocks or ("pp" in fixed and pp != fixed["pp"]):
                continue
            dp_total = world // (tp * cp * pp)
            if global_batch % dp_total:
                continue
            per_replica = global_batch // dp_total
            for zero, dp, shard, ep in _with_experts(stats, _layouts(dp_total, tp, pp, per_node, options), fixed):
                stage_params = stage_param_count(stats, tp=tp, pp=pp, ep=ep)
                states = model_state_bytes(
                    stage_params, policy, zero=zero, shard=shard * cp
                )  # cp folds into the shard group
                if sum(states.values()) > limit and not keep_all:
                    continue  # pruned: nothing below can make the model states smaller
                for m in divisors(per_replica):
                    if options.max_microbatches is not None and m > options.max_microbatches:
                        break
                    if "microbatches" in fixed and m != fixed["microbatches"]:
                        continue
                    for schedule, v in _schedules(stats, pp, m, options):
                        for recompute in options.recompute:
                            found, count, done = _price_options(
                                stats,
                                cluster,
                                global_batch,
                                options,
                                keep_all=keep_all,
                                lean=lean,
                                layout={
                                    "dp": dp,
                                    "shard": shard,
                                    "tp": tp,
                                    "pp": pp,
                                    "cp": cp,
                                    "ep": ep,
                                    "zero": zero,
                                    "schedule": schedule,
                                    "microbatches": m,
                                    "virtual_stages": v,
                                    "sequence_parallel": options.sequence_parallel and tp > 1,
                                    "recompute": recompute,
                                    "precision": options.precision,
                                },
                            )
                            out += found
                            evaluated += count
                            if done:
                                break  # more recomputation is only slower
    return out, evaluated


def _least_memory(
    stats: ModelStats, cluster: ClusterSpec, global_batch: int, options: SearchOptions
) -> Estimate | None:
    leanest = replace(
        options,
        recompute=options.recompute if "recompute" in options.fixed else ("full",),
        schedules=options.schedules if "schedule" in options.fixed else ("1f1b", "gpipe", "interleaved_1f1b"),
    )
    every, _ = _enumerate(stats, cluster, global_batch, leanest, keep_all=True, lean=True)
    return min(every, key=lambda e: e.memory_total, default=None)


def _min_devices(stats: ModelStats, cluster: ClusterSpec, global_batch: int, options: SearchOptions) -> int | None:
    lean = replace(
        options,
        recompute=("full",),
        zero_stages=(1, 3),
        schedules=("1f1b", "gpipe"),
        hsdp=False,
        supported=None,
        fixed={},
    )
    devices = cluster.devices
    while devices < 2**20:
        devices *= 2
        bigger = cluster.with_devices(devices, max(cluster.devices_per_node, 1))
        if _enumerate(stats, bigger, global_batch, lean)[0]:
            return devices
    return None
