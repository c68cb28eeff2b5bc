"""The LM head and its cross-entropy, chunk by chunk over the tokens, with the backward in the same pass.

For the head's input ``h`` ``[N, d]`` (N tokens), its weight ``W`` ``[V, d]`` and bias ``b``, the
logits are ``z = h W^T + b`` and, for targets ``y`` (``y_i = ignore_index`` for tokens that do not
count)::

    L   = (1 / D) * sum_{i valid} (lse_i - z_{i, y_i}),      lse_i = log sum_v exp z_{iv}
    G   = dL/dz = (softmax(z) - onehot(y)) / D                 (zero rows for ignored tokens)
    dh  = G W,   dW = G^T h,   db = sum_i G_i

with ``D`` the number of valid targets (``reduction="mean"``, ``F.cross_entropy``'s default) or 1
(``"sum"``). :func:`linear_cross_entropy` goes over chunks of ``C`` tokens: for each it computes
``z_c`` (``C x V``, in fp32), its loss, ``G_c`` in place of ``z_c``, ``dh_c = G_c W`` and adds
``G_c^T h_c`` to ``dW``; then the chunk's logits are freed. The backward only multiplies the stored
``dh``, ``dW``, ``db`` by the incoming scalar gradient (the loss scale, ``1/k`` of accumulation).
This is the design of Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024), which
:mod:`shardwise.parallel.chunked_loss` uses instead on a GPU where it is installed.

Memory (bytes, ``t`` the tensor-parallel degree, ``c`` the compute dtype's size): no ``[N, V]``
tensor. From the loss's forward to its backward: ``dh``, ``N d`` in the head input's dtype
(fp32 under autocast over fp32 parameters, 16-bit under ``params16``), and ``dW``/``db`` in the
parameter's dtype (``V/t x d``: the gradient the head gets anyway, only earlier). While the
forward runs: the fp32 accumulator of ``dW`` (``4 V/t d``; it *is* the saved ``dW`` for fp32
parameters, a 16-bit copy of it is made at the end otherwise), the 16-bit copy of ``W`` when
autocast casts it (``c V/t d``), and one chunk at a time: ``z_c`` in fp32 (``4 C V/t``, the
softmax and ``G_c`` are computed in place of it) and, for a 16-bit compute dtype, ``G_c``'s 16-bit
copy for the two gradient matmuls (``2 C V/t``), and the chunk's product ``G_c^T h_c`` in the
compute dtype (``c V/t d``) until it is added into the fp32 ``dW``. With :func:`chunk_tokens`'
``C = N d / (V/t)`` one chunk's logits are ``N d`` elements: ``(4 + 2) N d`` bytes, the size of the
head's input.

Compute: the same three matmuls as the unchunked head (forward, ``dh``, ``dW``: ``6 N d V`` flops
in all), no recomputation; the softmax is done once, in fp32.

Precision: the matmuls run in the compute dtype (autocast's when it is on, else the weight's);
the log-sum-exp, the softmax and the gradient of the logits always in fp32; ``dW`` is accumulated
over chunks in fp32. In fp32 the result equals ``F.cross_entropy(F.linear(h, W, b), y)`` and its
gradients up to the order of summation.

Tensor parallel (vocabulary-parallel, Megatron-LM's cross-entropy, Shoeybi et al. 2019): when
``W`` is a DTensor sharded by vocabulary rows (``Shard(0)``) over the ``tp`` group, each rank holds
``V/t`` rows and ``z_c`` is its ``[C, V/t]`` slice. Per chunk: the row maxima are all-reduced (MAX),
then the sums of exponentials and the target logits (each held by one rank) are all-reduced (SUM),
3 all-reduces of ``C`` floats; ``dh``'s partial sums are all-reduced (SUM) once over ``[N, d]``
(the volume of the unchunked head's backward all-reduce); ``dW`` and ``db`` stay local.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from shardwise.errors import ConfigError
from shardwise.parallel.local import local_tensor

REDUCTIONS = ("mean", "sum")


def chunk_tokens(tokens: int, *, hidden: int, vocab_local: int) -> int:
    """Tokens per chunk: as many as make one chunk's logits the size of the head's input
    (``C * V/t = N * d``, so ``C = ceil(N d / (V/t))``), between 1 and ``N``. A large vocabulary
    (``V/t >> d``) gets ``V / (t d)`` chunks; a vocabulary no larger than ``d`` one chunk."""
    return max(1, min(tokens, math.ceil(tokens * hidden / max(vocab_local, 1))))


@dataclass(frozen=True)
class _Spec:
    chunk: int
    ignore_index: int
    reduction: str
    group: Any  # the tp process group when the weight is vocabulary-sharded, else None
    vocab_start: int  # the first vocabulary row this rank holds


def _vocab_shard(weight: torch.Tensor) -> tuple[Any, int]:
    """(tp group, first row) of a vocabulary-sharded DTensor weight; (None, 0) for a whole one."""
    if not isinstance(weight, DTensor):
        return None, 0
    sharded = [i for i, p in enumerate(weight.placements) if isinstance(p, Shard)]
    if any(weight.placements[i].dim != 0 for i in sharded) or len(sharded) > 1:
        raise ConfigError(
            f"the chunked loss needs the LM head's weight split by vocabulary rows, not {weight.placements}",
            hint="use the 'lm_head' TP style for the head, or drop chunked_loss",
        )
    if not sharded:
        return None, 0
    mesh_dim = sharded[0]
    mesh = weight.device_mesh
    rows = weight.to_local().shape[0]
    if weight.shape[0] % mesh.size(mesh_dim):
        raise ConfigError(
            f"the LM head's vocabulary of {weight.shape[0]} does not split evenly over tp={mesh.size(mesh_dim)}",
            hint="pad the vocabulary to a multiple of tp",
        )
    return mesh.get_group(mesh_dim), mesh.get_local_rank(mesh_dim) * rows


class _LinearCrossEntropy(torch.autograd.Function):
    """The module doc's forward (loss and all gradients, chunk by chunk) and backward (a scaling)."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                spec: _Spec) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])
        y = targets.reshape(-1).to(h.device)
        if y.shape[0] != h.shape[0]:
            raise ConfigError(f"the chunked loss got {h.shape[0]} hidden states but {y.shape[0]} targets",
                              hint="targets must hold one class id per token of the model's input")
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        w, b = local_tensor(weight), local_tensor(bias)
        device_type = h.device.type
        compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else w.dtype
        with torch.autocast(device_type, enabled=False):
            wc = w.to(compute)
            valid = y != spec.ignore_index
            count = valid.sum()
            denom = count.clamp_min(1).float() if spec.reduction == "mean" else torch.ones((), device=h.device)
            vocab = wc.shape[0]
            dh = torch.empty_like(h) if need_h else None
            dw = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if need_w else None
            db = torch.zeros(b.shape, dtype=torch.float32, device=h.device) if b is not None and need_b else None
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for start in range(0, h.shape[0], spec.chunk):
                stop = start + spec.chunk
                hc, yc, vc = h[start:stop].to(compute), y[start:stop], valid[start:stop]
                z = (hc @ wc.t()).float()  # [C, V/t]
                if b is not None:
                    z += b.float()
                zmax = z.max(dim=1).values
                if spec.group is not None:
                    dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=spec.group)
                z -= zmax[:, None]  # shifted logits: exp cannot overflow
                local = (yc - spec.vocab_start).clamp(0, vocab - 1)[:, None]
                mine = vc & (yc >= spec.vocab_start) & (yc < spec.vocab_start + vocab)  # this rank holds y_i
                picked = torch.where(mine, z.gather(1, local).squeeze(1), torch.zeros_like(zmax))
                z.exp_()
                sums = torch.stack([z.sum(dim=1), picked])
                if spec.group is not None:
                    dist.all_reduce(sums, group=spec.group)
                lse = sums[0].log()  # of the shifted logits, so lse - picked = lse_i - z_{i, y_i}
                total += torch.where(vc, lse - sums[1], torch.zeros_like(lse)).sum()
                if dh is None and dw is None and db is None:
                    continue
                z /= sums[0][:, None]  # softmax
                z.scatter_add_(1, local, -mine.float()[:, None])  # - onehot(y)
                z *= (vc.float() / denom)[:, None]  # G_c, zero rows for ignored tokens
                g = z.to(compute)
                if dh is not None:
                    dh[start:stop] = (g @ wc).to(h.dtype)
                if dw is not None:
                    dw += g.t() @ hc  # added in fp32 as it is read: no fp32 copy of the product
                if db is not None:
                    db += z.sum(dim=0)
                del z, g
            if dh is not None and spec.group is not None:
                dist.all_reduce(dh, group=spec.group)  # each rank held the part of dh from its vocabulary rows
            loss = total / denom
            if spec.reduction == "mean":  # F.cross_entropy's mean over no valid target is nan
                loss = torch.where(count > 0, loss, torch.full_like(loss, float("nan")))
        ctx.hidden_shape = hidden.shape
        ctx.layouts = [_layout(weight), _layout(bias)]
        ctx.dtypes = [hidden.dtype, weight.dtype, bias.dtype if bias is not None else None]
        ctx.save_for_backward(*(t.to(d) if t is not None else None for t, d in zip((dh, dw, db), ctx.dtypes)))
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        dh, dw, db = ctx.saved_tensors
        scale = local_tensor(grad)
        out = []
        for t, layout in zip((dh, dw, db), [None, *ctx.layouts]):
            if t is None:
                out.append(None)
                continue
            t = t * scale.to(t.dtype)
            if layout is not None:  # a DTensor parameter's gradient: its local part in its layout
                mesh, placements, shape, stride = layout
                t = DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
            out.append(t)
        return out[0].reshape(ctx.hidden_shape) if out[0] is not None else None, out[1], out[2], None, None


def _layout(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    if not isinstance(t, DTensor):
        return None
    return (t.device_mesh, t.placements, t.shape, t.stride())


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, -2), targets.flatten(), ...)``
    computed chunk by chunk (module doc); a plain fp32 scalar on every rank. ``weight``/``bias``
    may be vocabulary-sharded DTensors (then each tp rank passes the same ``hidden`` and
    ``targets``). ``chunk``: tokens per chunk (default :func:`chunk_tokens`)."""
    if reduction not in REDUCTIONS:
        raise ConfigError(
            f"chunked loss reduction {reduction!r} is unknown", hint=f"use one of {', '.join(REDUCTIONS)}"
        )
    if isinstance(hidden, DTensor):
        raise ConfigError(
            "the chunked loss got the LM head's input as a DTensor",
            hint="the head's input must be this rank's plain tensor",
        )
    group, start = _vocab_shard(weight)
    tokens = hidden.numel() // hidden.shape[-1]
    size = chunk or chunk_tokens(tokens, hidden=hidden.shape[-1], vocab_local=local_tensor(weight).shape[0])
    spec = _Spec(chunk=max(1, size), ignore_index=ignore_index, reduction=reduction, group=group, vocab_start=start)
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, spec)
