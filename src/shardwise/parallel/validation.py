"""Check a :class:`~shardwise.layout.Plan` against a model without any communication:
:func:`validate`, which :func:`shardwise.parallel.parallelize.parallelize` calls first and which
stays importable from :mod:`shardwise.parallel.parallelize`; it returns the TP styles to apply."""

from __future__ import annotations

from torch import nn

from shardwise.errors import ConfigError
from shardwise.layout import Plan
from shardwise.parallel.annotate import annotated_styles
from shardwise.parallel.chunked_loss import find_lm_head
from shardwise.parallel.cp import check_context_parallel
from shardwise.parallel.ep import check_expert_parallel
from shardwise.parallel.pipeline.schedule import PipelineOptions, check_pipeline
from shardwise.parallel.tp.adapters import adapter_styles
from shardwise.parallel.tp.styles import TPOptions, TPStyles, derive_tp_styles, validate_tp
from shardwise.plan.support import runtime_conflict


def validate(
    model: nn.Module, plan: Plan, *, tp: TPOptions | None = None, pipeline: PipelineOptions | None = None
) -> TPStyles | None:
    """Check ``plan`` against ``model`` without any communication; return the TP styles to apply.

    Call it before building meshes so bad input fails before any process-group work
    (:func:`parallelize` calls it again first thing).
    """
    conflict = runtime_conflict(plan)  # e.g. zero=1 with tp or pp
    if conflict is not None:
        raise conflict
    check_pipeline(model, plan, options=pipeline)  # too many stages, tied weights across stages, ...
    check_context_parallel(model, plan.cp)  # attention inside torch modules, no position_ids
    check_expert_parallel(model, plan.ep)  # no MoE layers, ep not dividing the experts
    if plan.chunked_loss:
        find_lm_head(model)  # a model without an LM head says so before any process-group work
    if not plan.tp_enabled:
        return None
    quantized = next((n for n, p in model.named_parameters() if type(p.data).__name__ == "NF4Tensor"), None)
    if quantized is not None:
        raise ConfigError(
            f"plan {plan}: tp cannot split the 4-bit NF4 weight {quantized} (torchao splits NF4 tensors along rows "
            "only, and a row-wise layer needs its columns split)",
            hint="use zero=3 (or dp) for QLoRA, or lora.base=fp32 with tp",
        )
    options = tp or TPOptions()
    if options.styles is not None:
        tp_styles = TPStyles.of(options.styles)
    else:
        tp_styles = annotated_styles(model, tp=plan.tp) or derive_tp_styles(model, tp=plan.tp)
    if plan.ep_enabled:
        # Expert parallel owns the experts' tensors (split by expert over ep): TP leaves them whole,
        # so the tp ranks of one expert-parallel rank hold, and compute, the same experts.
        tp_styles = TPStyles(tuple((pattern, style) for pattern, style in tp_styles.entries if style != "experts"))
    tp_styles = adapter_styles(model, tp_styles)  # LoRA layers: base_layer, lora_A, lora_B follow the base's style
    validate_tp(model, tp_styles, tp=plan.tp)
    styles = set(tp_styles.as_dict().values())
    if plan.sequence_parallel and not {"sequence_parallel", "attention_input"} <= styles:
        # Rowwise outputs would be left sequence-sharded with nothing to gather them back.
        raise ConfigError(
            f"plan {plan}: sequence parallel needs norm ('sequence_parallel') and 'attention_input' entries "
            "in the TP plan",
            hint="use the derived plan (no annotations), add those entries, or drop sp",
        )
    return tp_styles
