"""Optimizers that need whole matrices, exact under every plan (docs/optimizers.md).

- :class:`Muon` (``muon.py``): Muon on the hidden matrices, AdamW on the rest; Newton–Schulz on
  whole matrices or their units (``newton_schulz.py``), reached through one bucketed all-to-all to
  owner ranks (``exchange.py``); which parameter is what (``units.py``).
- :func:`muon` (``factory.py``): the Trainer's optimizer argument for it.
- :func:`check` (``classify.py``): the refusal of an optimizer that a plan would run wrongly.
"""

from shardwise.optim.classify import allows, check, factory_kind, kind
from shardwise.optim.factory import MuonFactory, muon
from shardwise.optim.muon import Muon
from shardwise.optim.newton_schulz import Units, newton_schulz, orthogonalize
from shardwise.optim.units import Routing, route

__all__ = [
    "Muon",
    "MuonFactory",
    "Routing",
    "Units",
    "allows",
    "check",
    "factory_kind",
    "kind",
    "muon",
    "newton_schulz",
    "orthogonalize",
    "route",
]
