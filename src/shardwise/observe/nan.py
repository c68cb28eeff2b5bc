"""NaN / inf detection: which step, which rank, and the first module that produced it.

:class:`NanGuard` (optional, one call per step) checks the loss and the gradients, and locates the
source with hooks:

- **forward**: a hook on every submodule records ``isfinite(output).all()`` as a device tensor (no
  host sync in the hook); post-hooks run innermost-first in execution order, so the first flag that
  is false names the first module whose output was not finite;
- **backward**: gradients are checked per parameter after backward (``torch._foreach_norm``: one
  fused kernel), in reverse module order, which is the order backward produces them.

The check itself synchronizes the host once per step (one ``.item()``-like read of a stacked flag).
In a distributed job the verdict is made collective with one ``all_reduce(MAX)`` of a single flag, so
every rank takes the same action, and on a detection one ``all_gather_object`` brings every rank's
finding to the report: the rank whose *forward* went bad is named first (with DDP the non-finite
gradients then reach every rank through the all-reduce, which the report says).

Policy: ``"stop"`` raises :class:`NonFiniteError` on every rank; ``"skip"`` drops this step's
gradients (``p.grad = None``, so the optimizer leaves the parameters alone) and returns ``False``;
``"warn"`` only reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.runtime.logging import get_logger

log = get_logger("observe")
Policy = Literal["stop", "skip", "warn"]
_STAGE_ORDER = {"forward": 0, "loss": 1, "gradient": 2}


class NonFiniteError(ShardwiseError):
    """Raised on every rank by a :class:`NanGuard` with ``policy="stop"``."""


@dataclass(frozen=True)
class Finding:
    """What one rank saw at one step."""

    step: int
    rank: int
    stage: str  # forward | loss | gradient
    module: str  # qualified module name ("" is the root), or the parameter's module for gradients
    detail: str

    def describe(self) -> str:
        where = f"module '{self.module}'" if self.module else "the root module"
        if self.stage == "loss":
            return f"rank {self.rank}: the loss is not finite ({self.detail})"
        return (
            f"rank {self.rank}: first non-finite {'output' if self.stage == 'forward' else 'gradient'} in {where} "
            f"({self.detail})"
        )


def format_findings(step: int, findings: list[Finding]) -> str:
    """The report: the earliest-stage finding first, then the rest."""
    ordered = sorted(findings, key=lambda f: (_STAGE_ORDER[f.stage], f.rank))
    lines = [f"non-finite values at step {step}:"] + [f"  {f.describe()}" for f in ordered]
    if ordered and ordered[0].stage == "forward" and any(f.stage == "gradient" for f in ordered[1:]):
        lines.append("  (non-finite gradients on the other ranks arrive through the gradient all-reduce)")
    return "\n".join(lines)


class NanGuard:
    """Per-step finiteness check with source location (see the module doc)."""

    def __init__(self, module: nn.Module, *, policy: Policy = "stop", check_grads: bool = True, locate: bool = True,
                 group: dist.ProcessGroup | None = None) -> None:
        if policy not in ("stop", "skip", "warn"):
            raise ShardwiseError(f"NaN policy {policy!r} is unknown", hint="use 'stop', 'skip' or 'warn'")
        self.module, self.policy, self.check_grads, self.locate, self.group = module, policy, check_grads, locate, group
        self._flags: list[tuple[str, torch.Tensor]] = []
        self._handles: list[Any] = []
        self.findings: list[Finding] = []  # the report of the last detection (all ranks)
        names = {id(m): _clean(n) for n, m in module.named_modules()}
        self._params = [(names[id(m)], pn, p) for m in reversed(list(module.modules()))
                        for pn, p in m.named_parameters(recurse=False) if p.requires_grad]

    def attach(self) -> "NanGuard":
        if self.locate:
            for name, sub in self.module.named_modules():
                self._handles.append(sub.register_forward_hook(self._make_hook(_clean(name))))
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _make_hook(self, name: str):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tensors = [t for t in _tensors(output) if t.is_floating_point() or t.is_complex()]
            if tensors:
                flag = torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all()
                self._flags.append((f"{name}|{type(module).__name__}", flag))
        return hook

    # -- the per-step check ------------------------------------------------------------------
    def local_finding(self, step: int, loss: torch.Tensor | None = None) -> Finding | None:
        """This rank's earliest sign of non-finite values at ``step`` (no communication)."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        flags, self._flags = self._flags, []
        if flags:
            ok = torch.stack([f.to("cpu") if f.device.type == "meta" else f for _, f in flags]).cpu()
            if not bool(ok.all()):
                first = int((~ok).nonzero()[0])
                name, kind = flags[first][0].split("|")
                return Finding(step, rank, "forward", name, f"{kind} output contains NaN or inf")
        if loss is not None and not bool(torch.isfinite(loss.detach()).all()):
            return Finding(step, rank, "loss", "", f"loss = {loss.detach().float().flatten()[0].item()}")
        if self.check_grads:
            grads = [(m, pn, p.grad) for m, pn, p in self._params if p.grad is not None]
            if grads:
                norms = torch.stack([n.float().cpu() for n in torch._foreach_norm([_local(g) for _, _, g in grads])])
                bad = ~torch.isfinite(norms)
                if bool(bad.any()):
                    i = int(bad.nonzero()[0])
                    module, pname, _ = grads[i]
                    return Finding(step, rank, "gradient", module, f"gradient of '{pname}' has norm {norms[i].item()}")
        return None

    def check(self, step: int, loss: torch.Tensor | None = None) -> bool:
        """Check this step; ``True`` when everything is finite. Collective in a distributed job (see module doc)."""
        finding = self.local_finding(step, loss)
        bad = finding is not None
        distributed = dist.is_initialized() and dist.get_world_size(self.group) > 1
        if distributed:
            flag = torch.tensor([1.0 if bad else 0.0], device=_device(self.module))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            bad = bool(flag.item() > 0)
        if not bad:
            return True
        if distributed:
            gathered: list[Finding | None] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, finding, group=self.group)
            self.findings = [f for f in gathered if f is not None]
        else:
            self.findings = [finding] if finding is not None else []
        report = format_findings(step, self.findings)
        if self.policy == "stop":
            raise NonFiniteError(
                report.replace("\n", " "),
                hint="lower the learning rate, add warm-up or gradient clipping, "
                "use bf16 instead of fp16, or check the named module's inputs",
            )
        log.warning(report + ("\nskipping this optimizer step" if self.policy == "skip" else ""))
        if self.policy == "skip":
            for _, _, p in self._params:
                p.grad = None
            return False
        return True


def _clean(name: str) -> str:
    # Wrappers (DDP, torch.compile, activation checkpointing) add prefixes users never wrote.
    for prefix in ("module.", "_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return "" if name in ("module", "_orig_mod") else name


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _device(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    if p is None or p.device.type == "meta":
        return torch.device("cpu")
    if dist.is_initialized() and dist.get_backend() == "gloo":
        return torch.device("cpu")
    return p.device
