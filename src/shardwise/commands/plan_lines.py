"""The lines ``shardwise plan`` prints beside its table: a ``--fixed`` layout as another framework
runs it, and each plan's throughput interval (:mod:`shardwise.plan.uncertainty`)."""

from __future__ import annotations


def framework_line(stats: object, cluster: object, global_batch: int, options: object, ours: object) -> str:
    """``--fixed``: the prediction is for shardwise's runtime (its options searched); this line
    prices the same keys as Megatron-LM, torchtitan or llm-foundry run a step (``--precision-policy
    16bit``: 16-bit parameters, a fused loss, sharded accumulation, nothing searched) beside it."""
    from dataclasses import replace

    from shardwise.plan.policy import RunPolicy
    from shardwise.plan.search import candidates

    run = (
        RunPolicy.sixteen_bit(selective=options.run.selective)
        if options.run and options.run.selective != "matmuls"
        else RunPolicy.sixteen_bit()
    )
    every = candidates(stats, cluster, global_batch=global_batch, options=replace(options, run=run, runtime_options=()))
    if not every:
        return "as another framework runs it (--precision-policy 16bit): no plan with these keys"
    fitting = [e for e in every if e.fits]
    theirs = fitting[0] if fitting else min(every, key=lambda e: e.memory_total)
    fit = "" if fitting else ", does NOT fit"
    return (
        "as Megatron-LM / torchtitan / llm-foundry run these keys (--precision-policy 16bit): "
        f"{theirs.tokens_per_s:.4g} tok/s, step {theirs.step_time_s:.4g} s, "
        f"{ours.step_time_s / theirs.step_time_s:.2f} x the speed predicted for shardwise{fit}"
    )


def interval_json(est: object, cluster: object) -> dict:
    """A plan's throughput interval for ``--json`` (:mod:`shardwise.plan.uncertainty`)."""
    from shardwise.plan.uncertainty import interval

    low, high, kind = interval(est, cluster)
    return {"tokens_per_s_interval": [low, high], "interval_kind": kind}


def interval_lines(estimates: list, cluster: object) -> str:
    """The first plan's throughput interval (from the cross-validated error of its kind of run on
    published runs) and which of the others lie inside it: their order is within the model's error."""
    from shardwise.plan.uncertainty import indistinct, interval_text

    text = f"#1 {interval_text(estimates[0], cluster)}"
    close = [f"#{i}" for i, e in enumerate(estimates[1:], 2) if indistinct(estimates[0], e, cluster)]
    if close:
        text += f"; {', '.join(close)} within it: ranked within the model's error"
    return text
