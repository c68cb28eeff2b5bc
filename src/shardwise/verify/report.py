"""What a parity run reports: :class:`ParityReport` (a layout's losses, gradient norms and weights
against the one-process reference, the verdict at a tolerance, and its printed form), with the NaN-aware
relative differences it compares. It stays importable from :mod:`shardwise.verify.parity`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable


@dataclass(frozen=True)
class ParityReport:
    plan: str
    losses: tuple[float, ...]
    ref_losses: tuple[float, ...]
    grad_norms: tuple[float, ...]
    ref_grad_norms: tuple[float, ...]
    weight_diffs: dict[str, float]  # name -> max|w - w_ref| / max|w_ref|
    memory: dict[str, int] = field(default_factory=dict)  # param/grad/optim bytes, local and ref_*
    seconds: float = 0.0  # wall time of the parallel run (set-up included)
    ref_moved: float = 0.0  # how far the reference's weights moved: max over tensors of max|w_T - w_0| / max|w_0|
    weight_rtol: float | None = None  # the weights' own tolerance (an adaptive optimizer's, module doc); None: rtol

    @property
    def loss_diff(self) -> float:
        return _worst(_rel(a, b) for a, b in zip(self.losses, self.ref_losses))

    @property
    def grad_norm_diff(self) -> float:
        return _worst(_rel(a, b) for a, b in zip(self.grad_norms, self.ref_grad_norms))

    @property
    def weight_diff(self) -> tuple[str, float]:
        # a NaN is the worst of all (max alone would keep whichever comes first)
        name = max(
            self.weight_diffs, key=lambda n: (self.weight_diffs[n] != self.weight_diffs[n], self.weight_diffs[n])
        )
        return name, self.weight_diffs[name]

    @property
    def reference_moved(self) -> bool:
        """Whether the reference trained at all: a gradient that is not zero and weights that
        changed. A layout whose gradients vanish, on both sides, compares nothing and cannot pass."""
        return self.ref_moved > 0 and any(n > 0 for n in self.ref_grad_norms)

    def weight_tolerance(self, rtol: float) -> float:
        return max(rtol, self.weight_rtol) if self.weight_rtol is not None else rtol

    def passed(self, rtol: float) -> bool:
        """Loss and grad norm within ``rtol``, the weights within :meth:`weight_tolerance` (a NaN
        fails), and the reference moved."""
        return (
            self.reference_moved
            and self.loss_diff <= rtol
            and self.grad_norm_diff <= rtol
            and self.weight_diff[1] <= self.weight_tolerance(rtol)
        )

    def format(self, rtol: float) -> str:
        name, wdiff = self.weight_diff
        rows = [
            f"plan {self.plan}: {len(self.losses)} steps against 1 process (same seed, same global batch)",
            f"  loss       max rel diff {self.loss_diff:.2e}   "
            f"(final {self.losses[-1]:.6f} vs {self.ref_losses[-1]:.6f})",
            f"  grad norm  max rel diff {self.grad_norm_diff:.2e}   "
            f"(final {self.grad_norms[-1]:.6f} vs {self.ref_grad_norms[-1]:.6f})",
            f"  weights    max rel diff {wdiff:.2e}   ({name})"
            + (
                f" [tolerance {self.weight_tolerance(rtol):g}: an adaptive optimizer]"
                if self.weight_rtol is not None
                else ""
            ),
            f"  verdict    {'PASS' if self.passed(rtol) else 'FAIL'} at rtol {rtol:g}"
            + ("" if self.reference_moved else " (the reference did not train: zero gradients or unchanged weights)"),
        ]
        return "\n".join(rows)


def _worst(values: Iterable[float]) -> float:
    """The largest of ``values``, NaN if any is (``max`` keeps whichever comes first)."""
    values = list(values)
    return float("nan") if any(v != v for v in values) else max(values)


def _rel(a: float, b: float) -> float:
    """``|a - b| / |b|``; two zeros compare as far apart as it gets (inf), since a vanished loss or
    gradient on both sides proves nothing, and a NaN stays NaN (it fails every comparison)."""
    if a == 0 and b == 0:
        return float("inf")
    return abs(a - b) / max(abs(b), 1e-12)
