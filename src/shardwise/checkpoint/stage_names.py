"""Checkpoint names of a rank that holds several pipeline stages (``virtual_stages > 1``).

Each pipeline stage keeps the original parameter names (``blocks.3.attn.q_proj.weight``), so a
checkpoint written under ``pp=2`` names its tensors exactly as one process does and loads under
any other layout. A rank of an interleaved schedule holds its stages in a
:class:`~shardwise.parallel.pipeline.LocalStages` ``ModuleList``, whose ``state_dict`` puts the
local stage index in front (``1.blocks.3...``): an index that means nothing under another layout.
:class:`StageNames` removes it on save and puts it back on load, for the model's and the
optimizer's state dicts (``get_state_dict`` keys the optimizer's state by the same names).

Two local stages never hold the same name (the first and last stage, which share tied weights,
sit on different ranks whenever ``pp > 1``); a clash would be refused rather than silently merged.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from shardwise.errors import ConfigError
from shardwise.parallel.pipeline.schedule import LocalStages


class StageNames:
    """``plain(name)`` / ``local(name)`` between a module's state-dict names and checkpoint names."""

    def __init__(self, model: nn.Module | None, local_names: Iterable[str]) -> None:
        self.active = isinstance(model, LocalStages)
        self._to_local: dict[str, str] = {}
        if not self.active:
            return
        for name in local_names:
            plain = name.split(".", 1)[1]
            if plain in self._to_local:
                raise ConfigError(
                    f"two local pipeline stages both hold {plain!r}", hint="checkpoint this model under another split"
                )
            self._to_local[plain] = name

    def plain(self, name: str) -> str:
        return name.split(".", 1)[1] if self.active else name

    def local(self, name: str) -> str:
        return self._to_local.get(name, name) if self.active else name

    def model_out(self, msd: dict[str, Any]) -> dict[str, Any]:
        return {self.plain(k): v for k, v in msd.items()} if self.active else msd

    def model_in(self, msd: dict[str, Any]) -> dict[str, Any]:
        return {self.local(k): v for k, v in msd.items()} if self.active else msd

    def optim_out(self, osd: dict[str, Any]) -> dict[str, Any]:
        return self._optim(osd, self.plain)

    def optim_in(self, osd: dict[str, Any]) -> dict[str, Any]:
        return self._optim(osd, self.local)

    def _optim(self, osd: dict[str, Any], rename) -> dict[str, Any]:
        if not self.active:
            return osd
        out = dict(osd)
        if "state" in osd:
            out["state"] = {rename(k): v for k, v in osd["state"].items()}
        if osd.get("param_groups") is not None:
            out["param_groups"] = [{**g, "params": [rename(p) for p in g["params"]]} for g in osd["param_groups"]]
        return out
