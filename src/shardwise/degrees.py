"""The fill-in rules of a plan's degrees (:meth:`shardwise.layout.Plan.from_dict`): the degrees a plan
string leaves out, for a world size or without one, the default number of pipeline microbatches, and
the valid degree combinations error messages suggest. Below :mod:`shardwise.layout`, it imports
nothing of shardwise but its errors."""

from __future__ import annotations

from typing import Any

from shardwise.errors import ConfigError


def suggest_degrees(world_size: int) -> str:
    """A few valid degree combinations for a world size, for error messages."""
    options = [f"dp={world_size}"]
    for tp in (2, 4, 8):
        if world_size % tp == 0 and world_size > tp:
            options.append(f"dp={world_size // tp},tp={tp}")
        elif world_size == tp:
            options.append(f"tp={tp}")
    if world_size % 2 == 0 and world_size > 1:
        options.append(f"zero=3,shard={world_size}")
    return " or ".join(options[:3])


def default_microbatches(pp: int, virtual_stages: int = 1) -> int:
    """Microbatches when a plan names none: one per stage and virtual stage (the fewest that keep
    every stage of a 1F1B or interleaved schedule busy); 1 without a pipeline."""
    return pp * virtual_stages if pp > 1 else 1


def fill_degrees(values: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The degrees :meth:`Plan.from_dict` fills in for ``world_size`` (named keys are kept)."""
    out = dict(values)
    fixed = 1
    for key in ("tp", "pp", "cp"):
        value = out.get(key, 1)
        fixed *= value if isinstance(value, int) and value > 0 else 1
    given = ",".join(f"{k}={v}" for k, v in values.items())
    named = "tp*pp*cp" if "cp" in out else "tp*pp"
    if world_size % fixed:
        raise ConfigError(
            f"plan {given}: {named}={fixed} does not divide the world of {world_size} processes",
            hint=f"use degrees whose product divides {world_size}, e.g. {suggest_degrees(world_size)}",
        )
    rest = world_size // fixed
    if out.get("zero", 0) > 0:
        if "shard" not in out and "dp" not in out:
            out["shard"], out["dp"] = rest, 1
        elif "dp" not in out:
            shard = out["shard"]
            if not isinstance(shard, int) or shard < 1 or rest % shard:
                raise ConfigError(
                    f"plan {given}: shard={shard} does not divide the {rest} data-parallel ranks of "
                    f"{world_size} processes",
                    hint=f"use a shard degree that divides {rest}, or leave shard out (shard={rest})",
                )
            out["dp"] = rest // shard
    elif "dp" not in out:
        out["dp"] = rest
    return out


def fill_expert_ranks(values: dict[str, Any]) -> dict[str, Any]:
    """Without a world size: ``ep=N`` alone asks for the N data-parallel ranks its experts are
    split over (``dp=N``, or ``shard=N`` under ZeRO), the smallest world that runs it."""
    out = dict(values)
    ep = out.get("ep", 1)
    if not isinstance(ep, int) or ep <= 1 or "dp" in out or "shard" in out:
        return out
    out["shard" if isinstance(out.get("zero", 0), int) and out.get("zero", 0) > 0 else "dp"] = ep
    return out
