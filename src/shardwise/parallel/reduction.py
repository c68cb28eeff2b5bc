"""How each micro-batch's loss is weighted, so that the reduced gradient is one process's update on
the whole global batch: by samples, or by the valid targets it holds (``loss_reduction``).

Notation: one optimizer step runs ``k`` micro-batches on each of the ``D`` ranks that see
different tokens (the ``tokens`` mesh, dp x cp); the data-parallel reduction (DDP's all-reduce,
FSDP's reduce-scatter) *averages* the ranks' gradients. Micro-batch ``i`` of rank ``r`` has loss
``L_ri`` (the user's ``loss_fn``, a mean) and, backward, is multiplied by ``w_ri``::

    gradient = (1 / D) sum_r sum_i w_ri grad L_ri

- ``"samples"``: ``w_ri = 1 / k``, so the gradient is the mean over the ``D k`` micro-batch means.
  That is the global-batch mean when every micro-batch weighs the same: a per-sample loss (MSE,
  classification) on micro-batches of equal size. It is wrong for a token-mean loss whose
  micro-batches hold different numbers of valid targets (padding, prompts at ``-100``): a short
  sequence would weigh as much as a long one.
- ``"tokens"``: ``w_ri = D n_ri / N``, where ``n_ri`` counts the targets of the micro-batch as this
  rank sees it (its context-parallel chunk) that are not ``ignore_index``, and ``N = sum_ri n_ri``
  over every micro-batch of the step on every rank. With ``L_ri = (1 / n_ri) sum_t l_t`` (a mean
  over its valid targets, what ``F.cross_entropy(..., ignore_index=-100)`` returns)::

      gradient = (1 / D) sum_r sum_i (D n_ri / N) grad L_ri = (1 / N) sum_{valid t} grad l_t

  the gradient of the mean over every valid target of the global batch: one process's update,
  under any accumulation, data, context, tensor, pipeline and expert parallelism. A micro-batch
  with no valid target weighs 0 (its loss, 0/0, is dropped; ``F.cross_entropy``'s gradient there
  is 0, a loss of your own must keep it finite).

**Communication** (tokens only): one all-reduce (SUM) of one int64 per step over the ``tokens``
group, before the first forward. The Trainer moves the step's targets to the device first and
counts them there; counts, total and weights stay 0-d tensors on the device, so the host never
waits for it. Tensor- and pipeline-parallel peers hold the same targets and count the same numbers.

**Pipelines.** A pipeline splits micro-batch ``i`` into ``m`` microbatches again: under
``"samples"`` each weighs ``1 / (k m)``; under ``"tokens"`` microbatch ``j`` weighs
``D n_rij / N``, counted by the last stage from the target it is handed (:class:`TokenShare`).

**A loss of your own** (a chunked LM head + cross-entropy, say) plugs in unchanged if it returns
the mean over the valid targets of its micro-batch, i.e. ``sum of per-token losses / n`` with ``n``
the count :func:`valid_targets` gives for the targets it is called with (tokens whose target is
``ignore_index`` neither add to the sum nor to ``n``). The step multiplies it by ``D n / N``, which
turns it into ``sum / (N / D)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from shardwise.errors import ConfigError

LOSS_REDUCTIONS = ("tokens", "samples")
IGNORE_INDEX = -100  # what torch's cross-entropy and Hugging Face's labels use for "no target"


def check_loss_reduction(value: Any) -> str:
    """``value`` if it is ``"tokens"`` or ``"samples"`` (a ConfigError naming them otherwise)."""
    if value not in LOSS_REDUCTIONS:
        raise ConfigError(
            f"loss_reduction={value!r} is unknown",
            hint="use 'tokens' (a mean over the valid targets, e.g. masked cross-entropy) "
            "or 'samples' (per-sample losses)",
        )
    return value


def valid_targets(targets: Any, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """How many of ``targets`` are not ``ignore_index`` (a 0-d int64 tensor on their device).

    ``targets`` must be integer class ids: a float target (MSE, soft labels) has no "ignored"
    value to count, and its loss is not a token mean."""
    if not isinstance(targets, torch.Tensor):
        raise ConfigError(
            f"loss_reduction='tokens' counts the valid targets of a tensor of class ids, got {type(targets).__name__}",
            hint="return targets as one integer tensor, or use loss_reduction='samples'",
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ConfigError(
            f"loss_reduction='tokens' needs targets that are integer class ids, got {targets.dtype}",
            hint="use loss_reduction='samples' for a loss that is not a mean over tokens (MSE, soft labels, a sum)",
        )
    return (targets != ignore_index).sum()


@dataclass(frozen=True)
class TokenShare:
    """``"tokens"``: the weight of any piece of the step's data is ``valid targets x per_token``,
    with ``per_token = D / N`` (a 0-d float32 tensor on the device, see the module doc)."""

    per_token: torch.Tensor
    ignore_index: int = IGNORE_INDEX

    def count(self, targets: Any) -> torch.Tensor:
        return valid_targets(targets, self.ignore_index).to(self.per_token.device)

    def weight(self, count: torch.Tensor) -> torch.Tensor:
        return count.to(self.per_token.device, torch.float32) * self.per_token


@dataclass(frozen=True)
class StepWeights:
    """What each micro-batch's mean loss is multiplied by before backward (the fp16 loss scale
    aside): ``weights[i]``; ``share`` for a pipeline's microbatches (None under ``"samples"``)."""

    weights: tuple[float | torch.Tensor, ...]
    counts: tuple[torch.Tensor, ...] | None = None  # "tokens": valid targets of each micro-batch on this rank
    share: TokenShare | None = None

    def contribution(self, i: int, loss: torch.Tensor) -> torch.Tensor:
        """Micro-batch ``i``'s share of the step's loss, ``weights[i] x loss`` (0 for a micro-batch
        without valid targets, whose loss is 0/0). Summed over the micro-batches and averaged over
        the ``D`` ranks, it is the global batch's mean loss."""
        weighted = loss * self.weights[i]
        if self.counts is None:
            return weighted
        return torch.where(self.counts[i].to(weighted.device) > 0, weighted, torch.zeros_like(weighted))


@dataclass(frozen=True)
class LossReduction:
    """The step's weighting (module doc): ``mode`` over the ranks of ``group`` (the ``tokens``
    group, ``ranks`` of them; None for one)."""

    mode: str = "samples"
    ignore_index: int = IGNORE_INDEX
    group: Any = None
    ranks: int = 1

    def __post_init__(self) -> None:
        check_loss_reduction(self.mode)

    @classmethod
    def over(cls, tokens_mesh: Any, mode: str, ignore_index: int = IGNORE_INDEX) -> LossReduction:
        """``mode`` over the ranks of ``tokens_mesh`` (``Meshes.tokens``: the ranks that hold different tokens)."""
        return cls(mode, ignore_index, tokens_mesh.get_group() if tokens_mesh.size() > 1 else None, tokens_mesh.size())

    @property
    def tokens(self) -> bool:
        return self.mode == "tokens"

    def weigh(self, targets: Sequence[Any], *, device: torch.device | str) -> StepWeights:
        """The weights of a step whose micro-batches have ``targets`` (as this rank's model sees
        them: its context-parallel chunk). Collective under ``"tokens"`` (every rank of ``group``
        calls it once per step): one all-reduce of one integer."""
        k = len(targets)
        if not self.tokens:
            return StepWeights(weights=(1.0 / k,) * k)
        counts = tuple(valid_targets(t, self.ignore_index) for t in targets)
        total = torch.stack([c.to(counts[0].device) for c in counts]).sum().to(device)
        if self.ranks > 1:
            dist.all_reduce(total, group=self.group)
        share = TokenShare(per_token=self.ranks / total.clamp_min(1).to(torch.float32), ignore_index=self.ignore_index)
        return StepWeights(weights=tuple(share.weight(c) for c in counts), counts=counts, share=share)

    def describe(self) -> str:
        """One line for the log: which mean the logged loss is."""
        if self.tokens:
            return (
                "loss: the mean over the valid targets of each global batch "
                f"(loss_reduction='tokens', ignore_index={self.ignore_index})"
            )
        return "loss: the mean over the micro-batches of their mean losses (loss_reduction='samples')"
