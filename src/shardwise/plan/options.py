"""shardwise's runtime options as knobs of the search, and what each one did for a plan.

Three options change a step's memory and time but not its math, so the search turns them on the
way it turns on recomputation (:mod:`shardwise.plan.search`); ``--fixed`` keys that name one fix it:

- ``params16`` (16-bit parameters for compute, fp32 sharded masters and reductions; any 16-bit
  precision): 16-bit activations and residual stream, no autocast casts or weight copies. Never
  slower and never larger in the cost model, so it is tried first;
- ``chunked_loss`` (the LM head and cross-entropy a chunk of tokens at a time): the full logits and
  their gradient are never held. On a GPU it is also faster than the unfused loss (less traffic
  per logit, its launches hidden behind the device); on a CPU its launches add up, so there it is
  tried only after the plan without it;
- ``sharded_accumulation`` (ZeRO-2/3 with several microbatches): no unsharded gradient buffer, but
  ``m`` reduce-scatters per step instead of one: a trade, tried only when the plan without it
  does not fit.

:func:`option_sets` lists the combinations in that order of preference (the first that fits is
taken, as with recomputation); :func:`option_notes` says, for a chosen plan, which option made the
difference: the one without which it would not fit, or how much step time each one saves.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from shardwise.errors import ConfigError
from shardwise.layout import Plan

RUNTIME_OPTIONS = ("params16", "chunked_loss", "sharded_accumulation")


def option_sets(
    *,
    precision: str,
    zero: int,
    shard: int,
    microbatches: int,
    has_logits: bool,
    device_type: str,
    allowed: tuple[str, ...],
    fixed: dict[str, Any],
    for_memory: bool = False,
) -> list[dict[str, bool]]:
    """The option combinations worth pricing for one layout, in the order the search tries them
    (see the module doc); a key in ``fixed`` takes only its value, one not in ``allowed`` stays off.
    ``for_memory`` (``shardwise plan --runtime-options memory``): every option is tried off first,
    so one is on only where the plan does not fit without it, never for speed alone."""

    def choices(name: str, usable: bool, prefer_on: bool) -> list[bool]:
        if name in fixed:
            return [bool(fixed[name])]
        if not usable or name not in allowed:
            return [False]
        return [True, False] if prefer_on and not for_memory else [False, True]

    p16 = choices("params16", precision != "fp32", True)
    chunked = choices("chunked_loss", has_logits, device_type != "cpu")
    sharded = choices("sharded_accumulation", zero >= 2 and shard > 1 and microbatches > 1, False)
    if zero < 2:  # the plan value refuses it below ZeRO-2
        sharded = [False]
    return [
        {"params16": a, "chunked_loss": b, "sharded_accumulation": c} for a in p16 for c in sharded for b in chunked
    ]


def costs_time(options: dict[str, bool]) -> bool:
    """Whether a combination may cost step time (sharded accumulation's extra reduce-scatters): then
    more recomputation is still worth pricing, it may be faster."""
    return options["sharded_accumulation"]


def option_notes(est: Any, price: Callable[[Plan], Any]) -> list[str]:
    """For each runtime option ``est``'s plan turns on: the plan priced without it (``price``), and
    one phrase saying what the option did — made the plan fit, or saved step time (or cost some,
    for sharded accumulation, which buys memory with communication)."""
    notes = []
    for name in RUNTIME_OPTIONS:
        if not getattr(est.plan, name):
            continue
        try:
            without = price(replace(est.plan, **{name: False}))
        except ConfigError:  # a plan the cost model refuses without the option
            continue
        if est.fits and not without.fits:
            notes.append(
                f"{name} makes it fit ({without.memory_total / 1e9:.3g} GB without it, "
                f"{est.memory_limit / 1e9:.3g} GB usable)"
            )
            continue
        saved = without.step_time_s - est.step_time_s
        mem = (without.memory_total - est.memory_total) / 1e9
        if abs(saved) < 1e-3 * without.step_time_s and abs(mem) < 0.01:
            continue  # on, but it changes nothing worth saying for this plan
        said = []
        if abs(saved) >= 1e-3 * without.step_time_s:
            said.append(
                f"{'saves' if saved >= 0 else 'costs'} {_s(abs(saved))} per step "
                f"({100 * abs(saved) / without.step_time_s:.1f}%)"
            )
        if abs(mem) >= 0.01:
            said.append(f"{'saves' if mem >= 0 else 'needs'} {abs(mem):.3g} GB")
        notes.append(f"{name} " + ", ".join(said))
    return notes


def _s(x: float) -> str:
    return f"{x:.3g} s" if x >= 1e-3 else f"{x * 1e3:.3g} ms"


__all__ = ["RUNTIME_OPTIONS", "costs_time", "option_notes", "option_sets"]
