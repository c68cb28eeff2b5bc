"""FP8 training: ``nn.Linear`` layers converted to torchao's ``Float8Linear`` (``precision="fp8"``).

A converted layer computes ``y = x W^T`` as a scaled FP8 GEMM (Micikevicius et al. 2022, "FP8
Formats for Deep Learning"): each operand is multiplied by a scale ``s = fp8_max / amax`` and cast
to FP8 (forward: ``x`` and ``W`` in e4m3; backward: the output gradient in e5m2 for tensorwise,
e4m3 for rowwise), the GEMM accumulates in high precision and divides the scales back out. The
master weights, gradients and optimizer state stay fp32, like every other precision here.

Recipes (``Plan.fp8_recipe``), torchao's by name:

- ``tensorwise``: one scale per tensor (``amax`` over the whole tensor; under TP and FSDP that
  amax is over the full, unsharded tensor, one all-reduce of a scalar);
- ``rowwise``: one scale per row of each operand (torchao's "rowwise" recipe), more accurate for
  activations with outliers.

Scales are *dynamic*: recomputed from the tensors of the step itself, so there is no scaling state
(torchao 0.18 has no delayed scaling and no amax history). A checkpoint holds the weights and the
scales follow from them, so resume is exact by construction.

**Power-of-two scales** (``Fp8Options.power_of_2_scales``, on by default; torchao's rowwise recipe
already does it): every scale is rounded down to a power of two. Then ``q(x) = round_fp8(x s) / s``
is the same as rounding ``x`` to the FP8 mantissa for every ``x`` in the normal range, whatever
``s`` is, so the result no longer depends on which tokens share a tensor: a data-parallel rank's
half batch, a pipeline microbatch or the whole batch of one process give the same FP8 values
(only subnormals, ``|x| < 2^-6 / s``, can differ). That is what makes every plan agree with one
process to float32 rounding (tests/distributed/test_fp8.py). ``False`` is torchao's tensorwise
recipe exactly (then a scale depends on the batch split, and plans agree to FP8 rounding only).

**What stays in high precision** (:func:`fp8_filter`): the LM head (its logits feed the softmax
directly; torchtitan keeps its ``output`` layer out too), any Linear whose in or out features are
not a multiple of 16 (the FP8 GEMM kernels' hard requirement), and whatever the user's ``filter``
rejects. :func:`apply_fp8` logs one line naming what was converted and what was not, and why.
Everything that is not converted (attention, norms, the LM head) runs in ``high_precision``:
bf16 by default (autocast, and FSDP's ``param_dtype``, as torchtitan does), or fp32.

Composition (the order is :mod:`shardwise.parallel.parallelize`'s; conversion comes first, on
each pipeline stage's own layers):

- **FSDP2** (ZeRO-2/3, tensorwise): ``enable_fsdp_float8_all_gather``: shards are cast to FP8
  before the all-gather, which then moves 1 byte per parameter instead of 2 (bf16) or 4. The
  weight scales are precomputed before each forward for all layers in one all-reduce
  (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, then rounded when power-of-two).
  Rowwise all-gathers in high precision (torchao supports FP8 all-gather for tensorwise only).
- **TP**: torchao's ``Float8ColwiseParallel``/``Float8RowwiseParallel`` for tensorwise layers with
  unrounded scales (:func:`float8_tp_style`); their casts use torchao's own unrounded scale, so
  with power-of-two scales (and for rowwise, as in torchtitan) torch's plain styles are used and
  the ``Float8Linear`` casts the DTensor itself (amax over the whole tensor). Without sequence
  parallel the two move the same bytes (a colwise input is replicated, a rowwise input is the
  colwise output); only SP's all-gather of the sequence could go in FP8.
- **PP**: each stage converts its own layers (the filter sees the whole model's names).
- **CP**: nothing changes (attention, where CP acts, is not a Linear; q/k/v and the MLP convert).
- **EP**: MoE experts are held as 3-D tensors, not ``nn.Linear``; torchao 0.18's FP8 grouped GEMM
  (``torchao.prototype.moe_training``) is a prototype that needs CUDA's ``_scaled_grouped_mm``, so
  the experts stay in high precision and the log line says so; their router and the dense layers
  convert.

``emulate`` (torchao's ``Float8LinearConfig.emulate``): the FP8 numerics with high-precision
GEMMs, on any device; ``None`` picks it where there is no FP8 GEMM (a CPU, a GPU below compute
capability 8.9).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.tp.layers import expert_weights
from shardwise.runtime.logging import get_logger

log = get_logger("parallel")

HighPrecision = Literal["bf16", "fp32"]
Filter = Callable[[nn.Module, str], bool]  # (layer, dotted name) -> convert it?
ALIGN = 16  # FP8 GEMMs (torch._scaled_mm) need both dimensions of the weight to be multiples of 16
_HEAD_NAMES = {"lm_head", "head", "output", "out_head", "unembed", "logits"}


@dataclass(frozen=True)
class Fp8Options:
    """How ``precision="fp8"`` converts and runs (the recipe is the plan's ``fp8_recipe``).

    - ``filter(layer, name) -> bool``: which Linear layers may convert (None: all); layers with a
      dimension that is not a multiple of 16 stay in high precision whatever it says;
    - ``keep_head``: keep the LM head in high precision (default True; False lets it convert);
    - ``high_precision``: what runs everything not converted, ``"bf16"`` (autocast; FSDP
      param_dtype) or ``"fp32"``;
    - ``power_of_2_scales``: round every scale down to a power of two (module doc);
    - ``emulate``: FP8 numerics with high-precision GEMMs; None: where no FP8 GEMM exists;
    - ``fsdp_float8_all_gather``: cast shards to FP8 before FSDP's all-gather (tensorwise only);
      None: on for tensorwise.
    """

    filter: Filter | None = None
    keep_head: bool = True
    high_precision: HighPrecision = "bf16"
    power_of_2_scales: bool = True
    emulate: bool | None = None
    fsdp_float8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        if self.high_precision not in ("bf16", "fp32"):
            raise ConfigError(
                f"Fp8Options high_precision={self.high_precision!r} is unknown", hint="use 'bf16' or 'fp32'"
            )
        if self.filter is not None and not callable(self.filter):
            raise ConfigError(
                f"Fp8Options filter={self.filter!r} is not callable", hint="pass a function (module, name) -> bool"
            )


@dataclass(frozen=True)
class Conversion:
    """What :func:`apply_fp8` did: converted layer names, and the others with the reason."""

    converted: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]  # (name, why it stays in high precision)

    def summary(self, recipe: str) -> str:
        kept = "; ".join(f"{n} ({why})" for n, why in self.kept[:8]) + (
            f" and {len(self.kept) - 8} more" if len(self.kept) > 8 else ""
        )
        shown = ", ".join(self.converted[:6]) + (
            f" and {len(self.converted) - 6} more" if len(self.converted) > 6 else ""
        )
        return (f"fp8 ({recipe}): {len(self.converted)} Linear layers converted ({shown or 'none'}); "
                f"kept in high precision: {kept or 'none'}")


def compute_precision(precision: str, options: Fp8Options | None) -> str:
    """The precision everything that is not an FP8 GEMM runs in: the plan's, except that
    ``"fp8"`` means the FP8 options' ``high_precision`` (bf16 unless told)."""
    if precision != "fp8":
        return precision
    return (options or Fp8Options()).high_precision


def _torchao() -> Any:
    """torchao's float8 package; one line naming the extra when it is missing."""
    try:
        # torchao logs a warning per CUDA kernel library it cannot load on a CPU-only build
        # (``_C_mxfp8``, ``_C_cutlass_90a``) and torch one per enum torchao registers with pytree:
        # not ours to show, and not the user's to act on; errors still pass.
        quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
        levels = [q.level for q in quiet]
        for q in quiet:
            q.setLevel(logging.ERROR)
        try:
            import torchao.float8 as float8
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
    except ImportError:
        raise ConfigError("precision='fp8' needs torchao (the float8 training API)",
                          hint="pip install 'shardwise[fp8]' (torchao 0.18), or use precision='bf16'") from None
    return float8


def needs_emulation(device: torch.device | str) -> bool:
    """True where there is no FP8 GEMM: a CPU, or a CUDA GPU below compute capability 8.9 (Ada/Hopper)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) < (8, 9)


def is_lm_head(model: nn.Module, name: str, module: nn.Module) -> bool:
    """An output projection onto the vocabulary: named like one (``lm_head``, ``output``, ...) or
    sharing its weight with an embedding table."""
    if name.rsplit(".", 1)[-1] in _HEAD_NAMES:
        return True
    weight = getattr(module, "weight", None)
    return any(isinstance(e, nn.Embedding) and e.weight is weight for e in model.modules())


def fp8_filter(model: nn.Module, options: Fp8Options) -> tuple[Filter, Conversion]:
    """The module filter :func:`apply_fp8` gives torchao, and what it will decide, by name."""
    converted: list[str] = []
    kept: list[tuple[str, str]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        out_f, in_f = module.weight.shape
        if options.keep_head and is_lm_head(model, name, module):
            kept.append((name, "LM head"))
        elif in_f % ALIGN or out_f % ALIGN:
            kept.append((name, f"{in_f}x{out_f} is not a multiple of {ALIGN}"))
        elif options.filter is not None and not options.filter(module, name):
            kept.append((name, "filter"))
        else:
            converted.append(name)
    for name, module in model.named_modules():
        if expert_weights(module) is not None:  # MoE experts as 3-D tensors: grouped GEMMs, not Linear layers
            kept.append((name, "grouped expert GEMMs (torchao's FP8 grouped GEMM is a CUDA-only prototype)"))
    chosen = set(converted)
    return (lambda module, fqn: fqn in chosen), Conversion(tuple(converted), tuple(kept))


def fp8_config(recipe: str, options: Fp8Options, *, device: torch.device | str, fsdp: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` with shardwise's options applied."""
    float8 = _torchao()
    if recipe not in ("tensorwise", "rowwise"):
        raise ConfigError(f"fp8_recipe={recipe!r} is unknown", hint="use tensorwise or rowwise")
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    emulate = needs_emulation(device) if options.emulate is None else options.emulate
    all_gather = options.fsdp_float8_all_gather
    if all_gather and recipe != "tensorwise":
        raise ConfigError(f"FP8 all-gather needs the tensorwise recipe, not {recipe}",
                          hint="use fp8_recipe=tensorwise, or Fp8Options(fsdp_float8_all_gather=None)")
    all_gather = fsdp and recipe == "tensorwise" if all_gather is None else all_gather and fsdp
    return dataclasses.replace(
        config,
        emulate=emulate,
        enable_fsdp_float8_all_gather=all_gather,
        round_scales_to_power_of_2=options.power_of_2_scales or config.round_scales_to_power_of_2,
    )


def apply_fp8(model: nn.Module, *, recipe: str, options: Fp8Options | None = None, device: torch.device | str = "cpu",
              fsdp: bool = False, log_it: bool = True) -> Conversion:
    """Convert ``model``'s Linear layers in place to torchao's ``Float8Linear`` (module doc);
    ``fsdp``: FSDP2 shards the model next (tensorwise then all-gathers in FP8). On a pipeline
    stage it converts that stage's layers (their names are the whole model's). No communication.
    """
    options = options or Fp8Options()
    float8 = _torchao()
    config = fp8_config(recipe, options, device=device, fsdp=fsdp)
    keep, conversion = fp8_filter(model, options)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=keep)
    if log_it:
        log.info(conversion.summary(recipe) + (" (emulated: no FP8 GEMM on this device)" if config.emulate else ""))
    return conversion


def is_float8_tensorwise(module: nn.Module) -> bool:
    """A converted layer whose input is scaled tensorwise and unrounded (torchao's float8 TP styles' case)."""
    config = getattr(module, "config", None)
    if type(module).__name__ != "Float8Linear" or config is None:
        return False
    return (config.cast_config_input.scaling_granularity.value == "tensorwise"
            and not config.round_scales_to_power_of_2)


def float8_tp_style(
    module: nn.Module, style: str, *, output_layouts: Any = None, input_layouts: Any = None
) -> Any | None:
    """torchao's float8 TP style for a tensorwise ``Float8Linear`` with unrounded scales (module
    doc), or None where torch's plain style is the right one."""
    if not is_float8_tensorwise(module) or style not in ("colwise", "rowwise", "colwise_rep", "rowwise_rep"):
        return None
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    kwargs = {k: v for k, v in (("output_layouts", output_layouts), ("input_layouts", input_layouts)) if v is not None}
    return (Float8ColwiseParallel if style.startswith("colwise") else Float8RowwiseParallel)(**kwargs)


def precompute_scales_before_forward(model: nn.Module) -> None:
    """Register a forward pre-hook on the FSDP root that computes every FP8-all-gathered weight's
    scale in one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), rounded down
    to a power of two when the layers round theirs. Recomputed every forward, so the scales always
    follow the weights: after an optimizer step, after loading a checkpoint.

    Communication: one all-reduce (MAX) of one float per FP8 layer, over the weights' mesh.
    """
    float8 = _torchao()
    layers = [
        m for m in model.modules() if type(m).__name__ == "Float8Linear" and m.config.enable_fsdp_float8_all_gather
    ]
    if not layers:
        return
    power_of_2 = layers[0].config.round_scales_to_power_of_2

    def hook(_module: nn.Module, _args: Any) -> None:
        float8.precompute_float8_dynamic_scale_for_fsdp(model)
        if power_of_2:
            for layer in layers:
                inner = layer.weight._local_tensor
                scale = inner._precomputed_scale
                if scale is not None:
                    inner._precomputed_scale = torch.exp2(torch.floor(torch.log2(scale)))

    model.register_forward_pre_hook(hook)
