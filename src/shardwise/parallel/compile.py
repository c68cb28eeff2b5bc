"""Per-block ``torch.compile`` (``Plan.compile``), in torchtitan's order: after tensor parallel and
activation checkpointing (the compiled graph holds the TP DTensors' collectives and the
recomputation), before FSDP/DDP (whose hooks stay outside the graph, so all-gathers and
reduce-scatters overlap as in eager).

Each repeated trunk block is compiled on its own (``module.compile()``): the blocks share one code
object, and with torch's inlining of ``nn.Module`` calls (``inline_inbuilt_nn_modules``, the
default) their parameters are graph inputs, so one graph serves every block and compile time does
not grow with depth. A model without a trunk of repeated blocks is compiled whole.

Where inductor cannot run (no C++ compiler for CPU code, no Triton for CUDA), :func:`apply_compile`
says so in one line and leaves the model eager: the run is the same math, only slower.

:func:`compile_stats` reads dynamo's own counters (graphs compiled, graph breaks with their
reasons); the trainer logs them after the first step and warns whenever a later step compiled
again (a recompile: a guard failed, e.g. a new shape or dtype), :class:`~shardwise.observe.compile_log.CompileLog`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardwise.models.blocks import block_modules
from shardwise.runtime.logging import get_logger

log = get_logger("parallel")


def inductor_missing(device_type: str) -> str | None:
    """Why inductor cannot generate code for ``device_type`` here, or None when it can."""
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (inductor's CUDA code generator)"
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        get_cpp_compiler()
    except Exception as exc:  # InvalidCxxCompiler, or a broken toolchain
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"no C++ compiler for inductor's CPU code ({first[:120]})"
    return None


def apply_compile(model: nn.Module, *, device_type: str) -> list[nn.Module]:
    """Compile each trunk block of ``model`` (the whole model without one) in place; returns
    what was compiled, [] when inductor cannot run here (logged once, the model stays eager)."""
    missing = inductor_missing(device_type)
    if missing is not None:
        log.warning("plan compile: running eagerly, %s; install one (e.g. apt-get install g++) to compile", missing)
        return []
    units = block_modules(model) or [model]
    if getattr(getattr(model, "config", None), "use_cache", False) and len(units) > 1:
        # A Hugging Face model's KV cache is indexed by the layer's number, a constant each layer's
        # graph specializes on: one graph per layer (dynamo stops compiling after 8 of them).
        log.warning("plan compile: model.config.use_cache is True; set it to False for training so that "
                    "the %d layers share one compiled graph instead of one each", len(units))
    for unit in units:
        unit.compile()
    return units


@dataclass(frozen=True)
class CompileStats:
    """Dynamo's counters in this process: graphs compiled, graph breaks (total and by reason)."""

    graphs: int
    graph_breaks: int
    reasons: tuple[tuple[str, int], ...]

    def summary(self) -> str:
        why = "; ".join(f"{r[:80]} (x{n})" for r, n in self.reasons[:3])
        return f"{self.graphs} graphs compiled, {self.graph_breaks} graph breaks" + (f": {why}" if why else "")


def compile_stats() -> CompileStats:
    """The current :class:`CompileStats` (dynamo keeps them per process, across models)."""
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    reasons = tuple(sorted(breaks.items(), key=lambda kv: -kv[1]))
    return CompileStats(
        graphs=int(counters["stats"]["unique_graphs"]), graph_breaks=sum(breaks.values()), reasons=reasons
    )


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` or one of its submodules was compiled with ``module.compile()``."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())

