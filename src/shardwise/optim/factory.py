"""``shardwise.optim.muon(...)``: the Trainer's optimizer argument for Muon + AdamW.

The Trainer builds the optimizer on the parallelized model, whose parameter *names* say what each
matrix is (:mod:`shardwise.optim.units`); a factory that only saw the parameters could not tell an
embedding from a hidden layer. So ``Trainer(optimizer=shardwise.optim.muon(lr=0.02))`` hands the
factory the model (:meth:`MuonFactory.for_module`), which routes its parameters, logs how many went
where, and builds one :class:`~shardwise.optim.muon.Muon` with a Muon group and an AdamW group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable

import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.optim.classify import check
from shardwise.optim.muon import Muon
from shardwise.optim.units import Routing, route
from shardwise.runtime.logging import get_logger

if TYPE_CHECKING:
    from shardwise.parallel.parallelize import ParallelModel

log = get_logger("optim")
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class MuonFactory:
    """Muon's options (:class:`~shardwise.optim.muon.Muon`'s keyword arguments) and the routing
    overrides ``muon``/``adamw`` (fnmatch patterns of parameter names)."""

    kind: ClassVar[str] = "muon"  # what shardwise.optim.factory_kind reports: exact under every plan
    options: dict[str, Any] = field(default_factory=dict)
    muon: tuple[str, ...] = ()
    adamw: tuple[str, ...] = ()

    def routing(self, module: nn.Module) -> Routing:
        return route(module, muon=self.muon, adamw=self.adamw)

    def for_module(self, module: nn.Module) -> Muon:
        """The optimizer over ``module``'s trainable parameters (module doc)."""
        r = self.routing(module)
        if not r.muon:
            raise ConfigError(f"Muon found no matrix to orthogonalize in {type(module).__name__}: {r.summary()}",
                              hint="use AdamW, or name the matrices in shardwise.optim.muon(muon=[...])")
        log.info(r.summary())
        groups = [{"params": [p for _, p in r.muon], "muon": True}]
        if r.adamw:
            groups.append({"params": [p for _, p in r.adamw], "muon": False})
        units = {id(p): r.units[n] for n, p in r.muon}
        return Muon(groups, units=units, **self.options)

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        raise ConfigError(
            "shardwise.optim.muon(...) needs the model's parameter names to tell matrices from embeddings",
            hint="pass it to Trainer(optimizer=...), or call .for_module(model) in your own loop",
        )


def muon(*, muon: Iterable[str] = (), adamw: Iterable[str] = (), **options: Any) -> MuonFactory:
    """A Muon + AdamW optimizer for ``Trainer(optimizer=...)`` (module doc); ``options`` are
    :class:`~shardwise.optim.muon.Muon`'s (``lr``, ``momentum``, ``ns_dtype``, ``adjust_lr``,
    ``adamw_lr`` ...), checked now."""
    Muon([torch.zeros(2, 2, requires_grad=True)], **options)  # a bad option fails here, not in the job
    return MuonFactory(options=dict(options), muon=tuple(muon), adamw=tuple(adamw))


def build_optimizer(pm: ParallelModel, optimizer: OptimizerFactory | MuonFactory) -> torch.optim.Optimizer:
    """The optimizer on the final (possibly sharded) parameters, refused in one line if the plan
    would run it wrongly (:func:`shardwise.optim.check`: a whole-tensor optimizer on shards). The
    Trainer, ``prepare()``, ``shardwise verify`` and certification all build it here.
    ``shardwise.optim.muon(...)`` is built from the named parameters of the parallel module (it
    needs the names to route them); its state is not ZeRO-1-partitioned (it keeps whole matrices)."""
    if isinstance(optimizer, MuonFactory):
        opt: torch.optim.Optimizer = optimizer.for_module(pm.module)
    else:
        opt = pm.build_optimizer(optimizer)  # ZeRO-1 wraps it to shard its state
    check(opt, pm.plan)
    return opt


def reference_optimizer(module: nn.Module, optimizer: OptimizerFactory | MuonFactory) -> torch.optim.Optimizer:
    """One process's optimizer over ``module`` (the parity reference): the same factory, on whole
    parameters."""
    if isinstance(optimizer, MuonFactory):
        return optimizer.for_module(module)
    return optimizer(module.parameters())
