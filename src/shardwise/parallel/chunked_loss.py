"""``Plan.chunked_loss``: the LM head and the cross-entropy computed chunk by chunk inside the loss,
so the full ``[tokens, vocab]`` logits and their gradient are never held at once.

How it is wired (:func:`install_chunked_head`, called by ``parallelize`` before any other step):

- the model's LM head is found (:func:`find_lm_head`: a Hugging Face model's
  ``get_output_embeddings()``, else a Linear named ``lm_head``/``head``/``output``..., else the last
  Linear whose outputs match an embedding's rows) and its class is swapped for a subclass (the way
  ``fully_shard`` swaps classes) whose forward, **while training with gradients**, returns its
  input, the hidden states, instead of the logits. Names, parameters, ties and checkpoints are
  unchanged; in evaluation, prediction and generation the head computes the logits as before;
- the training loss becomes :class:`ChunkedLoss` (``ParallelModel.loss_for(loss_fn)``; on the last
  pipeline stage the schedule's loss): it takes the hidden states from the model's output (a
  tensor, a ``ModelOutput``'s ``logits`` or a tuple's first element) and runs
  :func:`~shardwise.parallel.linear_ce.linear_cross_entropy` with the head's weight and bias
  (tied embeddings: the shared parameter, so both uses' gradients add up). On a GPU with
  ``liger-kernel`` installed (``pip install 'shardwise[liger]'``) and a head that tensor
  parallelism does not split, Liger's fused linear cross-entropy runs instead (the same math).
- under tensor parallelism the head keeps its vocabulary split (``Shard(0)``) and its input
  hook (all-gather of the sequence under SP); its output hook returns the replicated hidden states
  while training (:class:`ChunkedHeadParallel`), and the loss is vocabulary-parallel.

It applies only where the model's loss is the token cross-entropy of the head's logits, and says
so in one line otherwise: no LM head found (or one that is not an ``nn.Linear``); a ``loss_fn``
that is not the token mean (or sum) of ``F.cross_entropy`` with ``ignore_index=-100`` (checked once
on a random batch of logits, :func:`loss_reduction`); or a model that changes the head's output
before returning it (a soft-cap, a scale, a slice: checked on every step, the returned tensor must
be the one the head returned).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

from shardwise.errors import ConfigError
from shardwise.models.hf import logits_of
from shardwise.parallel.linear_ce import REDUCTIONS, linear_cross_entropy

IGNORE_INDEX = -100
_HEAD_NAMES = {"lm_head", "head", "output", "out_head", "unembed", "logits", "embed_out"}
_STASH = "_shardwise_head_output"  # the head's last pass-through output, checked by the loss


def passes_through(head: nn.Module) -> bool:
    """Whether ``head`` returns its input now: while training with gradients (the loss then
    applies the head by chunks); evaluation and ``torch.no_grad()`` get the logits."""
    return head.training and torch.is_grad_enabled()


class _ChunkedHead:
    """Mixed in before the head's own class (see the module doc)."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not passes_through(self):  # type: ignore[arg-type]
            return super().forward(x, *args, **kwargs)  # type: ignore[misc]
        self.__dict__[_STASH] = x.to_local() if isinstance(x, DTensor) else x
        return x


def is_chunked_head(module: nn.Module) -> bool:
    return isinstance(module, _ChunkedHead)


def find_lm_head(model: nn.Module) -> tuple[str, nn.Linear]:
    """``(name, module)`` of the model's LM head (module doc), or a ConfigError saying it has none."""
    names = {m: n for n, m in model.named_modules()}
    for module in model.modules():
        get = getattr(module, "get_output_embeddings", None)
        if callable(get):
            try:
                head = get()
            except (AttributeError, NotImplementedError):
                head = None
            if isinstance(head, nn.Module) and head in names:
                return names[head], _linear(names[head], head)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    named = [(n, m) for n, m in linears if n.rsplit(".", 1)[-1] in _HEAD_NAMES]
    if not named:
        rows = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
        named = [(n, m) for n, m in linears if m.out_features in rows]
    if not named:
        raise ConfigError(
            f"plan chunked_loss cannot apply: {type(model).__name__} has no LM head "
            "(an nn.Linear named lm_head, head or "
            "output, or whose outputs match an embedding's rows)",
            hint="drop chunked_loss, or name the model's head lm_head",
        )
    return named[-1]


def _linear(name: str, head: nn.Module) -> nn.Linear:
    if not isinstance(head, nn.Linear):
        raise ConfigError(
            f"plan chunked_loss cannot apply: the LM head {name} is a {type(head).__name__}, not an nn.Linear",
            hint="drop chunked_loss",
        )
    return head


def install_chunked_head(model: nn.Module) -> nn.Module:
    """Swap the class of ``model``'s LM head (module doc); return the head. Idempotent."""
    name, head = find_lm_head(model)
    if not is_chunked_head(head):
        cls = type(head)
        head.__class__ = type(f"Chunked{cls.__name__}", (_ChunkedHead, cls), {"__module__": cls.__module__})
    return head


class ChunkedHeadParallel(ColwiseParallel):
    """Tensor parallel style of a chunked head: torch's colwise head (weight and bias split by
    vocabulary rows, input replicated, under SP all-gathered along the sequence); its output is
    the logits as the ``lm_head`` style gives them, or while the head passes its input through,
    this rank's replicated hidden states as a plain tensor."""

    def __init__(self, *, sequence_parallel: bool, loss_parallel: bool) -> None:
        super().__init__(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                         output_layouts=Shard(-1) if loss_parallel else Replicate(), use_local_output=not loss_parallel)

    @staticmethod
    def _prepare_output_fn(
        output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any
    ) -> Any:
        if passes_through(mod):
            return outputs.to_local()  # the replicated hidden states
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def loss_reduction(loss_fn: Callable[[Any, Any], torch.Tensor], vocab: int) -> str:
    """``"mean"`` or ``"sum"``: which token cross-entropy ``loss_fn`` computes, checked on a random
    ``[2, 3, vocab]`` batch of logits with one ignored (``-100``) target; a ConfigError if neither."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, vocab, generator=gen)
    targets = torch.randint(0, vocab, (2, 3), generator=gen)
    targets[0, 1] = IGNORE_INDEX
    hint = (
        "pass the token cross-entropy (F.cross_entropy over the flattened logits, or shardwise.models.hf.lm_loss), "
        "or drop chunked_loss"
    )
    try:
        with torch.no_grad():
            got = loss_fn(logits, targets)
    except Exception as exc:  # noqa: BLE001 - any failure of user code means it cannot be checked
        raise ConfigError(
            f"plan chunked_loss cannot apply: loss_fn failed on a [2, 3, {vocab}] batch of logits "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})",
            hint=hint,
        ) from None
    value = (
        float(got.full_tensor() if isinstance(got, DTensor) else got)
        if isinstance(got, torch.Tensor) and got.numel() == 1
        else None
    )
    for reduction in REDUCTIONS:
        want = float(
            F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction=reduction)
        )
        if value is not None and abs(value - want) <= 1e-4 * abs(want):
            return reduction
    mean = float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX))
    raise ConfigError(
        f"plan chunked_loss cannot apply: loss_fn is not the token cross-entropy of the logits (it gives {value} on a "
        f"random batch whose mean cross-entropy is {mean:.6f})",
        hint=hint,
    )


class ChunkedLoss:
    """The training loss under ``chunked_loss``: ``loss(output, targets)`` on the model's output,
    whose "logits" are the head's input while training (module doc); otherwise ``loss_fn``."""

    def __init__(
        self, head: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor], *, chunk: int | None = None
    ) -> None:
        if not is_chunked_head(head):
            raise ConfigError(
                "ChunkedLoss needs the head install_chunked_head prepared", hint="use ParallelModel.loss_for(loss_fn)"
            )
        self.head, self.loss_fn, self.chunk = head, loss_fn, chunk
        self.reduction = loss_reduction(loss_fn, head.out_features)

    def __call__(self, output: Any, targets: torch.Tensor) -> torch.Tensor:
        if not passes_through(self.head):
            return self.loss_fn(output, targets)
        hidden = logits_of(output)  # the head's output: a tensor, a ModelOutput's .logits or a tuple's first
        returned = self.head.__dict__.pop(_STASH, None)
        if returned is None or not _same_tensor(hidden, returned):
            raise ConfigError(
                f"plan chunked_loss cannot apply: {type(output).__name__} is not what the LM head returned "
                "(the model changes the logits after its head: a soft-cap, a scale, a cast or a slice)",
                hint="drop chunked_loss for this model",
            )
        weight, bias = self.head.weight, self.head.bias
        if hidden.is_cuda and not isinstance(weight, DTensor) and importlib.util.find_spec("liger_kernel") is not None:
            return _liger(hidden, weight, bias, targets, reduction=self.reduction)
        return linear_cross_entropy(
            hidden, weight, bias, targets, ignore_index=IGNORE_INDEX, reduction=self.reduction, chunk=self.chunk
        )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values in the same memory (a view of the head's output in the same layout counts)."""
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
    )


def _liger(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, *, reduction: str
) -> torch.Tensor:
    """Liger-Kernel's fused linear cross-entropy (GPU only), in the compute dtype: autocast's when it
    is on, else the weight's (its Triton kernels take one dtype for the input and the weight)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    with torch.autocast(device, enabled=False):
        loss = liger_fused_linear_cross_entropy(
            hidden.flatten(0, -2).to(dtype),
            weight.to(dtype),
            targets.flatten().to(hidden.device),
            bias=bias.to(dtype) if bias is not None else None,
            ignore_index=IGNORE_INDEX,
            reduction=reduction,
        )
    return loss.float()
