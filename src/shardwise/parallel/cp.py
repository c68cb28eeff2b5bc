"""Context parallel: each sample's sequence split over the ``cp`` ranks, attention by all-gathered K/V.

**Load-balanced chunks (zig-zag).** A sequence of length ``S`` is cut into ``2 cp`` chunks of
``c = S / (2 cp)`` tokens; rank ``r`` keeps chunks ``r`` and ``2 cp - 1 - r``. Under a causal mask a
chunk's attention work grows with its position, so pairing an early chunk with a late one gives
every rank the same work (Brandon et al. 2023, "Striped Attention"; the "zig-zag" of ring-flash-
attention and torchtitan's head-tail load balancer). Token ids, targets and position ids are all
taken at the same positions, so embeddings, rotary tables and the loss are computed on the local
chunks only.

**Attention: all-gather of K/V** (chosen over ring attention here). Each rank computes ``q, k, v``
for its ``2c`` tokens, all-gathers ``k`` and ``v`` over the ``cp`` group (``(cp - 1)/cp`` of the
sequence's K/V arrives per layer, forward; the gradients return by reduce-scatter, backward) and
attends its queries to every key at or before each query's global position::

    out_r = softmax(q_r K^T * scale + mask(pos_q_r >= pos_K)) V      with K, V = all_gather(k), all_gather(v)

This is exactly the single-process attention for those queries, on any backend (Gloo/CPU
included, where torch's ring-attention ``context_parallel`` has no kernel). The whole sequence's K
and V (``2 S h/tp`` elements) exist only while one layer's attention runs: the gather and the
attention are recomputed in backward (one more all-gather and attention forward per layer), so
what a layer keeps for backward is its own chunk's. Ring attention would overlap the transfer with compute and
never hold all of K/V; torch's ``context_parallel`` provides it on GPUs (flash / efficient
attention kernels).

**How it reaches the model.** The model stays single-device code: a ``TorchFunctionMode`` active
during the step's forward (and entered again around each recomputed block under activation
checkpointing) replaces each ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` call by the all-gathered
version, and the batch is sharded before the model sees it, with the chunks' global
``position_ids`` passed as a keyword where the outer ``forward`` takes them (by name or through
``**kwargs``). Every Hugging Face ``PreTrainedModel`` found in the module tree (a user's two-line
wrapper around one, a peft model, which calls its base model's ``forward`` directly, and the
decoder inside each) gets a forward pre-hook that, during a step, fills in the chunks'
``position_ids`` and an all-ones ``attention_mask`` of the local length where the call leaves them
out: the positions reach the model whatever the wrapper's signature, and without a mask
transformers would read the jump in the zig-zag positions as packed sequences and build a block
mask, which cannot be split. Contract: the attention calls ``scaled_dot_product_attention`` with
``is_causal=True`` and no mask; a Hugging Face model configured for eager attention is refused
before any process-group work (:func:`check_context_parallel`), and a model that calls no SDPA at
all after its first forward.

**Loss and gradients.** Each rank's loss is the mean over its ``2c`` tokens of each sample; every
rank holds the same number of tokens, so the mean over the ``tokens`` mesh (dp x cp) is the
single-process mean, and the gradient reduction over that mesh (DDP's all-reduce, FSDP's
reduce-scatter over dp_shard x cp) averages exactly as one process would.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, ContextManager, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from shardwise.errors import ConfigError

_UNSPLITTABLE = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
# torch >= 2.10 names them *_single; the older names remain for the supported range below that.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank ``rank`` of ``cp`` keeps: chunks ``rank`` and ``2 cp - 1 - rank``."""
    if seq_len % (2 * cp):
        raise ConfigError(
            f"cp={cp} needs a sequence length that is a multiple of 2*cp={2 * cp} (zig-zag chunks), got {seq_len}",
            hint=f"use sequences of a multiple of {2 * cp} tokens, or another cp",
        )
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)
    return torch.cat([first, second])


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over ``group`` (rank order); backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        world = dist.get_world_size(group)
        moved = x.movedim(dim, 0).contiguous()
        out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
        _all_gather(out, moved, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        world = dist.get_world_size(ctx.group)
        moved = grad.movedim(ctx.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
        _reduce_scatter(out, moved, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def causal_bias(q_positions: torch.Tensor, k_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[Sl, S]``: 0 where a key's position is at or before the query's, -inf after."""
    allowed = k_positions[None, :] <= q_positions[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=q_positions.device).masked_fill_(~allowed, float("-inf"))


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor,
                       group: dist.ProcessGroup, **sdpa: Any) -> torch.Tensor:
    """Causal attention of the local queries ``q[..., Sl, d]`` over the whole sequence (module doc).

    ``bias`` is :func:`causal_bias` of the local and the gathered positions (one tensor shared by
    every layer of a step, so autograd keeps one copy). Other keyword arguments (``scale``,
    ``dropout_p``, ``enable_gqa``) go to SDPA.
    """
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys = _GatherSequence.apply(k, k.dim() - 2, group)
        values = _GatherSequence.apply(v, v.dim() - 2, group)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, **sdpa)

    # Recomputed in backward (gather included), so a layer keeps only its local q, k, v: holding the
    # whole sequence's K and V for every layer would undo much of what cp saves.
    return torch.utils.checkpoint.checkpoint(attend, q, k, v, use_reentrant=False)


class _SplitAttention(TorchFunctionMode):
    """Replaces causal, mask-free SDPA calls by :func:`gathered_attention` while active."""

    def __init__(self, cp: ContextParallel) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        bound = {**dict(zip(names, args)), **kwargs}
        if bound.get("attn_mask") is not None or not bound.get("is_causal", False):
            raise ConfigError(
                f"cp={self.cp.size}: an attention call has a mask or is not causal, "
                "which context parallel cannot split",
                hint="use causal scaled_dot_product_attention(is_causal=True) without a mask, or drop cp",
            )
        self.cp.attention_calls += 1
        sdpa = {k: bound[k] for k in ("dropout_p", "scale", "enable_gqa") if k in bound}
        query = bound["query"]
        return gathered_attention(
            query, bound["key"], bound["value"], bias=self.cp.bias(query.dtype), group=self.cp.group, **sdpa
        )


@dataclass
class ContextParallel:
    """The ``cp`` part of a :class:`~shardwise.parallel.parallelize.ParallelModel`: shards batches
    along the sequence (dim 1) and splits attention while a step runs."""

    mesh: DeviceMesh
    # The model's forward takes ``attention_mask`` (Hugging Face models): shard_batch passes an
    # all-ones one of the local length. The chunks' causal structure comes from their positions,
    # which the split attention uses; without a mask, transformers reads the jump in the zig-zag
    # position_ids as packed sequences and builds a block mask attention cannot be split with.
    pass_attention_mask: bool = False
    # The model's forward takes ``position_ids`` (by name or ``**kwargs``): shard_batch passes them.
    # A wrapper that takes neither gets them through the hooks on the Hugging Face models inside.
    pass_position_ids: bool = True
    attention_calls: int = 0
    _active: int = field(default=0, repr=False)  # > 0 while a step's forward runs (split_attention)
    _positions: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)  # (local, gathered keys)
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)  # of the current batch

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    def key_positions(self, seq_len: int) -> torch.Tensor:
        """Global positions of the all-gathered keys, in rank order."""
        return torch.cat([zigzag_positions(seq_len, self.size, r) for r in range(self.size)])

    def shard_batch(self, inputs: Any, targets: Any) -> tuple[Any, Any, dict[str, Any]]:
        """This rank's zig-zag chunks of ``inputs`` (token ids ``[B, S]``, or a mapping with
        ``input_ids``) and of the per-token ``targets``, and the ``position_ids`` keyword (with an
        all-ones ``attention_mask`` for a model that takes one, see ``pass_attention_mask``)."""
        ids = inputs["input_ids"] if isinstance(inputs, Mapping) else inputs
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            raise ConfigError(f"cp={self.size} needs token inputs of shape [batch, sequence]",
                              hint="context parallel splits the sequence dimension (dim 1) of the inputs")
        positions = zigzag_positions(ids.shape[1], self.size, self.rank).to(ids.device)
        self._positions = (positions, self.key_positions(ids.shape[1]).to(ids.device))
        self._bias = {}
        take = _take(positions)
        local = {k: take(v) if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == ids.shape[1] else v
                 for k, v in inputs.items()} if isinstance(inputs, Mapping) else take(inputs)
        local_targets = take(targets) if isinstance(targets, torch.Tensor) and targets.dim() >= 2 else targets
        extra = {"position_ids": positions.unsqueeze(0).expand(ids.shape[0], -1)} if self.pass_position_ids else {}
        if self.pass_attention_mask and not (isinstance(inputs, Mapping) and "attention_mask" in inputs):
            extra["attention_mask"] = torch.ones(ids.shape[0], positions.numel(), dtype=torch.long, device=ids.device)
        return local, local_targets, extra

    def hook_models(self, model: nn.Module) -> int:
        """Register :meth:`_fill_in` as a forward pre-hook on every Hugging Face model in ``model``'s
        tree (module doc); returns how many were hooked."""
        found = hf_models(model)
        for module in found:
            module.register_forward_pre_hook(_FillIn(self, module), with_kwargs=True)
        return len(found)

    def local_targets(self, targets: Any) -> Any:
        """This rank's chunks of per-token ``targets`` (``[B, S]``, what :meth:`shard_batch` gives the
        loss), without touching the state of the current batch: for counting them before the step."""
        if not (isinstance(targets, torch.Tensor) and targets.dim() >= 2):
            return targets
        return _take(zigzag_positions(targets.shape[1], self.size, self.rank))(targets)

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The current batch's causal bias in ``dtype``, built once and shared by every layer."""
        if self._positions is None:
            raise ConfigError(
                "context parallel: shard_batch must run before the forward", hint="call pm.shard_batch(inputs, targets)"
            )
        if dtype not in self._bias:
            self._bias[dtype] = causal_bias(*self._positions, dtype)
        return self._bias[dtype]

    def recompute_context(self) -> ContextManager[Any]:
        """The split attention for a block's recomputation in backward (activation checkpointing):
        a function mode is switched off while it handles ``backward`` itself, so the checkpoint
        re-enters it around the recomputed forward."""
        return _SplitAttention(self) if self._positions is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def split_attention(self) -> Iterator[None]:
        """Active around a step's forward and backward (see the module doc)."""
        if self._positions is None:
            raise ConfigError(
                "context parallel: shard_batch must run before the forward", hint="call pm.shard_batch(inputs, targets)"
            )
        before = self.attention_calls
        self._active += 1
        try:
            with _SplitAttention(self):
                yield
        finally:
            self._active -= 1
        if self.attention_calls == before:
            raise ConfigError(
                f"cp={self.size}: the model's forward called no scaled_dot_product_attention(is_causal=True), "
                "so its attention cannot be split over the sequence",
                hint="use F.scaled_dot_product_attention in the attention (the built-in GPT and Hugging Face "
                "'sdpa' models do), or drop cp",
            )


class _FillIn:
    """Forward pre-hook of a Hugging Face model under cp (module doc): during a step, the chunks'
    ``position_ids`` and an all-ones ``attention_mask`` wherever the call passes none (by keyword
    or position)."""

    def __init__(self, cp: ContextParallel, module: nn.Module) -> None:
        self.cp = cp
        names = [n for n, p in inspect.signature(module.forward).parameters.items()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.index = {
            key: names.index(key)
            for key in ("input_ids", "attention_mask", "position_ids", "inputs_embeds")
            if key in names
        }

    def _given(self, key: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        if kwargs.get(key) is not None:
            return kwargs[key]
        i = self.index.get(key)
        return args[i] if i is not None and i < len(args) else None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        if self.cp._active <= 0 or self.cp._positions is None:
            return None
        local = self.cp._positions[0]
        source = self._given("input_ids", args, kwargs)
        if source is None:
            source = self._given("inputs_embeds", args, kwargs)
        if not isinstance(source, torch.Tensor) or source.dim() < 2 or source.shape[1] != local.numel():
            return None  # not this step's chunks (a call with other inputs): left alone
        batch = source.shape[0]
        kwargs = dict(kwargs)
        for key in ("position_ids", "attention_mask"):
            if self._given(key, args, kwargs) is not None:
                continue
            if key in self.index and self.index[key] < len(args):  # passed positionally as None
                args = args[:self.index[key]] + (None,) + args[self.index[key] + 1:]
            kwargs.pop(key, None)
            if key == "position_ids":
                value = local.to(source.device).unsqueeze(0).expand(batch, -1)
            else:
                value = torch.ones(batch, local.numel(), dtype=torch.long, device=source.device)
            if key in self.index and self.index[key] < len(args):
                args = args[:self.index[key]] + (value,) + args[self.index[key] + 1:]
            else:
                kwargs[key] = value
        return args, kwargs


def is_hf_model(module: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (by class name in its MRO: shardwise never imports transformers here)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__)


def hf_models(model: nn.Module) -> list[nn.Module]:
    """Every Hugging Face model in ``model``'s tree, outermost first."""
    return [m for m in model.modules() if is_hf_model(m)]


def _take(positions: torch.Tensor) -> Any:
    return lambda t: t.index_select(1, positions.to(t.device))


def takes_attention_mask(model: nn.Module) -> bool:
    """Whether ``model.forward`` has an ``attention_mask`` parameter (Hugging Face models do). A peft
    model forwards its keyword arguments to the model it wraps, which is the one asked."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return "attention_mask" in inspect.signature(inner.forward).parameters


def takes_position_ids(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``position_ids``, by name or through ``**kwargs``."""
    forward = inspect.signature(model.forward).parameters
    return "position_ids" in forward or any(p.kind is p.VAR_KEYWORD for p in forward.values())


def check_context_parallel(model: nn.Module, cp: int) -> None:
    """Refuse, before any process-group work, a model context parallel cannot split."""
    if cp <= 1:
        return
    for name, module in model.named_modules():
        if isinstance(module, _UNSPLITTABLE):
            raise ConfigError(
                f"cp={cp}: {name or 'the model'} ({type(module).__name__}) computes attention inside torch, "
                "where context parallel cannot split it",
                hint="use separate q/k/v Linear layers with F.scaled_dot_product_attention(is_causal=True), or drop cp",
            )
    seq_len = getattr(getattr(model, "config", None), "seq_len", None)
    if isinstance(seq_len, int) and seq_len % (2 * cp):
        raise ConfigError(f"cp={cp} needs a sequence length that is a multiple of 2*cp={2 * cp} (zig-zag chunks), "
                          f"but {type(model).__name__} has seq_len={seq_len}",
                          hint=f"use a seq_len that is a multiple of {2 * cp}, or another cp")
    inner = hf_models(model)
    eager = next(
        (m for m in inner if getattr(getattr(m, "config", None), "_attn_implementation", None) == "eager"), None
    )
    if eager is not None:
        name = next((n for n, m in model.named_modules() if m is eager), "") or type(model).__name__
        raise ConfigError(
            f"cp={cp}: {name} ({type(eager).__name__}) uses eager attention, which context parallel cannot split "
            "(it splits scaled_dot_product_attention calls)",
            hint="build the model with attn_implementation='sdpa' (config._attn_implementation = 'sdpa'), or drop cp",
        )
    forward = inspect.signature(model.forward).parameters
    if inner:  # the hooks on the Hugging Face models give them their positions (ContextParallel.hook_models)
        return
    if "position_ids" not in forward and not any(p.kind is p.VAR_KEYWORD for p in forward.values()):
        raise ConfigError(
            f"cp={cp}: {type(model).__name__}.forward takes no position_ids, so its chunks cannot know their positions",
            hint="add a position_ids=None argument used for the position embedding / rotary table, or drop cp",
        )
