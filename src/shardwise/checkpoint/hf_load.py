"""Weights in: a Hugging Face model directory into any plan, each rank reading only its own slices.

A directory written by ``save_pretrained`` (``config.json`` and ``model.safetensors``, or shards
listed in ``model.safetensors.index.json``) is loaded in four steps:

1. **build on meta**: the model class is built from ``config.json`` with every *parameter* on
   the meta device (no memory) while buffers are computed for real (rotary frequencies are
   buffers that no checkpoint holds);
2. **parallelize** the meta model with the plan (pipeline split, TP, FSDP: shapes only);
3. **allocate** this rank's shards (``to_empty``; with module parameters swapped in place, so a
   weight tied between the embedding and the head stays one parameter) and put the buffers back;
4. **read** each local shard straight from the safetensors files: the shard's region of the global
   tensor (from its DTensor placements; a TP-fused q|k|v weight held as (in, 3, H) is read as its
   3 pieces of the stored (in, 3H)) is read with ``safe_open(...).get_slice(key)[region]``, which reads only
   those bytes. A tied weight missing from the files (``lm_head.weight``) is read under the name
   it is stored as. Checkpoints that ``transformers`` converts on load (Mixtral's per-expert
   ``w1/w2/w3`` into fused ``gate_up_proj``/``down_proj``) are assembled from the same
   per-expert slices, following transformers' own conversion table (renames; stacking experts;
   concatenating pieces).

So under ZeRO-3 or TP a rank reads and holds about 1/N of each tensor and never the whole model;
:class:`LoadStats` counts it. Placements that are no single region (a fused projection sharded by
FSDP *and* TP) are read one whole tensor at a time and sliced (counted as such).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardwise.checkpoint.safetensors_files import Region, SafetensorsFiles, conversions, merged_shape, read_merged
from shardwise.checkpoint.weights_check import check_weights, tied_aliases
from shardwise.errors import ConfigError
from shardwise.models.hf import read_config, require_transformers



@dataclass(frozen=True)
class Pretrained:
    """A local Hugging Face model directory, to be built on meta and loaded per rank.

    Pass it where a model goes (``Trainer(Pretrained("dir"), ...)``), or use
    :func:`shardwise.from_pretrained`. ``lora`` (a :class:`~shardwise.models.lora.LoRA` or a
    ``peft.LoraConfig``) adds adapters to the meta model before it is parallelized; they start as
    ``get_peft_model`` makes them after ``torch.manual_seed(seed)`` on the real model, and the base
    is still read slice by slice. With ``LoRA(base="nf4")`` the frozen projections are quantized
    to 4 bits as they are read (:mod:`shardwise.models.nf4`).
    """

    path: str
    lora: Any = None
    seed: int = 0

    def config(self) -> Any:
        read_config(self.path)  # one line if the directory or its config.json is missing
        config = require_transformers().AutoConfig.from_pretrained(self.path, local_files_only=True)
        config.use_cache = False  # no KV cache in training (and none between pipeline stages)
        return config

    def build_meta(self) -> nn.Module:
        """The model with its parameters on the meta device and real buffers (module doc)."""
        tf = require_transformers()
        config = self.config()
        with parameters_on_meta():
            model = tf.AutoModelForCausalLM.from_config(config)
        if self.lora is not None:
            from shardwise.models.lora import add_adapters

            model = add_adapters(model, self.lora, seed=self.seed)  # real CPU adapters on the meta base
        return model

    @property
    def quantized(self) -> bool:
        """Whether the frozen base is stored in NF4 (``LoRA(base="nf4")``)."""
        return getattr(self.lora, "base", None) == "nf4"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Construct modules with parameters on the meta device and buffers on the CPU.

    ``nn.Module.register_parameter`` is wrapped for the duration of the block (and restored after
    it, also on error): each parameter is moved to meta as it is registered, before any
    initialization touches it (``torch.empty`` allocates address space, not memory).
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


@dataclass(frozen=True)
class LoadStats:
    """What this rank read: elements read from the files, elements it holds after loading, the
    model's total, the largest single read, and how many tensors had to be read whole."""

    elements_read: int
    elements_local: int
    elements_total: int
    largest_read: int
    whole_reads: int

    @property
    def fraction_read(self) -> float:
        return self.elements_read / max(1, self.elements_total)


# -- regions of a local shard --------------------------------------------------------------------
def _regions(param: torch.Tensor) -> list[tuple[Region, Region]] | None:
    """[(region of the global tensor, region of the local tensor)] covering this rank's shard, or
    None when the placements are no single region (read whole, then slice)."""
    shape = tuple(param.shape)
    whole = lambda dims: tuple(slice(0, n) for n in dims)  # noqa: E731
    if not isinstance(param, DTensor):
        return [(whole(shape), whole(shape))]
    local_shape = tuple(param.to_local().shape)
    try:
        local, offset = compute_local_shape_and_global_offset(shape, param.device_mesh, tuple(param.placements))
    except (NotImplementedError, ValueError, AssertionError):
        return None
    if tuple(local) != local_shape:
        return None
    return [(tuple(slice(o, o + n) for o, n in zip(offset, local)), whole(local))]


def _split_dim(stored: tuple[int, ...], held: tuple[int, ...]) -> int | None:
    """The dim of ``stored`` that ``held`` splits in two (a TP-fused weight: (in, 3H) held as (in, 3, H))."""
    for d in range(len(stored)):
        if (
            len(held) == len(stored) + 1
            and held[:d] == stored[:d]
            and held[d + 2 :] == stored[d + 1 :]
            and held[d] * held[d + 1] == stored[d]
        ):
            return d
    return None


def _read_viewed(read: Any, stored: tuple[int, ...], held: tuple[int, ...], region: Region) -> torch.Tensor:
    """``region`` of the stored tensor viewed with ``held``'s shape (one read per piece)."""
    if stored == held:
        return read(region)
    d = _split_dim(stored, held)
    if d is None:
        raise ConfigError(f"a checkpoint tensor of shape {list(stored)} does not fit a parameter of shape {list(held)}",
                          hint="load a checkpoint of the same model config")
    width = held[d + 1]
    lo, hi, _ = region[d + 1].indices(width)
    parts = []
    for j in range(*region[d].indices(held[d])):
        sub = (*region[:d], slice(j * width + lo, j * width + hi), *region[d + 2:])
        parts.append(read(sub))
    return torch.stack(parts, dim=d)


def _tensors(modules: Sequence[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer of the modules, once, by its original name."""
    seen: set[int] = set()
    out = []
    for module in modules:
        persistent = set(module.state_dict(keep_vars=True))
        for name, t in [*module.named_parameters(), *((n, b) for n, b in module.named_buffers() if n in persistent)]:
            if id(t) not in seen:
                seen.add(id(t))
                out.append((name, t))
    return out


@torch.no_grad()
def load_into(modules: Sequence[nn.Module], directory: str, *, model_type: str, aliases: dict[str, tuple[str, ...]],
              total: int, values: dict[str, torch.Tensor] | None = None) -> LoadStats:
    """Fill the (allocated) parameters and persistent buffers of ``modules`` from ``directory``
    (module doc, step 4). ``aliases``: every name of each tied weight. ``values``: whole tensors
    held in memory by name (LoRA adapters), sliced into their shards like the files are. A LoRA
    model's base parameters are looked up under their names in the original model
    (:func:`~shardwise.models.lora.base_key`)."""
    from shardwise.models.lora import base_key

    values = values or {}
    read = largest = whole = local_total = 0
    with SafetensorsFiles(directory) as files:
        keys, merged = conversions(model_type, list(files.files))
        missing = []
        for name, tensor in _tensors(modules):
            name = name.removeprefix("module.")
            candidates = [base_key(c) for c in (name, *aliases.get(name, ()))]
            key = next((keys[c] for c in candidates if c in keys), None)
            spec = next((merged[c] for c in candidates if c in merged), None)
            held_value = values.get(name)
            if held_value is not None:
                key, spec = None, None
            elif key is None and spec is None:
                if isinstance(tensor, nn.Parameter):
                    missing.append(name)
                continue
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            local_total += local.numel()
            held = tuple(tensor.shape)
            if held_value is not None:
                stored = tuple(held_value.shape)
                reader = lambda region, v=held_value: v[region]  # noqa: E731
            elif key is not None:
                stored = files.shape(key)
                reader = lambda region, key=key: files.read(key, region)  # noqa: E731
            else:
                stored = (len(spec.pieces[0]), *merged_shape(files, spec))
                reader = lambda region, spec=spec: read_merged(files, spec, region)  # noqa: E731
            regions = _regions(tensor)
            if regions is None:  # read whole, keep the local part (no communication)
                full = _read_viewed(reader, stored, held, tuple(slice(0, n) for n in held))
                read, largest, whole = read + full.numel(), max(largest, full.numel()), whole + 1
                local.copy_(
                    distribute_tensor(
                        full.to(local.device), tensor.device_mesh, tensor.placements, src_data_rank=None
                    ).to_local()
                )
                continue
            for glob, loc in regions:
                part = _read_viewed(reader, stored, held, glob)
                read, largest = read + part.numel(), max(largest, part.numel())
                local[loc].copy_(part)
        if missing:
            raise ConfigError(
                f"{directory} has no weights for {len(missing)} parameter(s) of the model, e.g. {missing[0]!r}",
                hint="load a checkpoint of the same model class and config (save_pretrained writes one)",
            )
    return LoadStats(
        elements_read=read, elements_local=local_total, elements_total=total, largest_read=largest, whole_reads=whole
    )


def allocate(module: nn.Module, *, device: torch.device | str, buffers: dict[str, torch.Tensor]) -> None:
    """``to_empty`` with parameters swapped in place (tied weights stay one parameter), then the
    construction-time buffer values put back."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        for name, b in module.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])


def load_parallel(source: Pretrained, plan: Any, meshes: Any, *, device: torch.device | str, **options: Any) -> Any:
    """Steps 1-4 of the module doc: the :class:`~shardwise.parallel.parallelize.ParallelModel` of
    ``source`` under ``plan``, its :class:`LoadStats` in ``load``. ``options`` go to
    ``parallelize`` (``loss_fn``, ``tp``, ``fsdp``, ``pipeline``, ``ddp``).

    Plain DDP (and ZeRO-1, which keeps DDP) holds the whole model on every rank anyway and
    broadcasts it when wrapping, so there the model is loaded first and wrapped after.
    """
    from shardwise.parallel.parallelize import parallelize
    from shardwise.parallel.pipeline.schedule import stage_modules

    model = source.build_meta()
    check_weights(source.path, model)  # a truncated file, a missing shard, a shape config.json does not give: one line
    model_type = getattr(model.config, "model_type", "")
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    aliases = tied_aliases(model)
    total = sum(p.numel() for p in model.parameters())
    held = _to_meta(model)  # LoRA adapters: made on the CPU, sliced into their shards after allocation
    whole_first = plan.dp_enabled and plan.zero < 2 and not plan.tp_enabled and not plan.pp_enabled
    if whole_first or source.quantized:
        # QLoRA: the 4-bit base is made from the whole weights (then ZeRO shards the 4-bit codes)
        allocate(model, device=device, buffers=buffers)
        stats = load_into([model], source.path, model_type=model_type, aliases=aliases, total=total, values=held)
        if source.quantized:
            from shardwise.models.nf4 import quantize_base

            quantize_base(model)
        pm = parallelize(model, plan, meshes, **options)
    else:
        pm = parallelize(model, plan, meshes, **options)
        modules = stage_modules(pm.module) if plan.pp_enabled else [pm.module]
        for module in modules:
            allocate(module, device=device, buffers=buffers)
        stats = load_into(modules, source.path, model_type=model_type, aliases=aliases, total=total, values=held)
    pm.load = stats
    if source.lora is not None:  # for the checkpoints' base reference and exports
        from shardwise.models.lora import peft_model_of

        peft_model = peft_model_of(model)
        if peft_model is not None:
            pm.lora_config = peft_model.peft_config["default"].to_dict()
    return pm


def _to_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """Move the model's real parameters (adapters made on the CPU) to meta; return their values by name."""
    held: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.is_meta:
                held[f"{module_name}.{name}" if module_name else name] = p.detach().clone()
                module._parameters[name] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    return held
