"""A tiny deterministic training job used by the checkpoint tests (no tests here; module-level so pool
and subprocesses can import it). Layouts are built from torch's own building blocks: DDP via
shardwise.parallelize, ZeRO-3 via ``fully_shard``, TP via ``parallelize_module``."""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from shardwise.checkpoint import CheckpointManager
from shardwise.checkpoint.components import local_optimizer
from shardwise.data.sampler import ShardedSampler
from shardwise.train.state import capture_rng, restore_rng

N_SAMPLES = 96
GLOBAL_BATCH = 8
PLANS = {"single": None, "dp2": "dp=2", "dp4": "dp=4", "zero1": "zero=1,shard={world}", "zero3": "zero=3,shard={world}",
         "tp2": "tp=2"}


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(N_SAMPLES, 8, generator=gen), torch.randn(N_SAMPLES, 4, generator=gen)


def make_model(seed: int, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, 4))


class TrainState:
    """Counters, data position and this rank's RNG streams (the trainer's "train_state")."""

    def __init__(self, sampler: ShardedSampler) -> None:
        self.step = 0
        self.sampler = sampler

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "rng": capture_rng()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        restore_rng(state["rng"])


class Job:
    """Model, optimizer, scheduler and data of one rank under ``layout``."""

    def __init__(self, layout: str, *, seed: int = 0, width: int = 32) -> None:
        from shardwise.parallel.mesh import build_mesh
        from shardwise.layout import Plan

        self.layout = layout
        world = dist.get_world_size() if dist.is_initialized() and layout != "single" else 1
        model = make_model(seed, width)
        self.dp_rank, self.dp_size, self.plan = 0, 1, None
        adamw = partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
        optimizer = None
        if layout != "single":
            self.plan = Plan.parse(PLANS[layout].format(world=world))
            meshes = build_mesh(self.plan, "cpu")
            self.dp_rank, self.dp_size = meshes.dp.get_local_rank(), meshes.dp.size()
            if layout.startswith("dp"):
                from shardwise.parallel.parallelize import parallelize

                model = parallelize(model, Plan.parse(f"dp={world}"), meshes).module
            elif layout == "zero1":  # DDP, each rank's Adam over its partition (ZeroRedundancyOptimizer)
                from shardwise.parallel.parallelize import parallelize

                pm = parallelize(model, self.plan, meshes)
                model, optimizer = pm.module, pm.build_optimizer(adamw)
            elif layout == "zero3":
                from torch.distributed.fsdp import fully_shard

                for layer in (model[0], model[3]):
                    fully_shard(layer, mesh=meshes.dp)
                fully_shard(model, mesh=meshes.dp)
            elif layout == "tp2":
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                parallelize_module(model, meshes.tp, {"0": ColwiseParallel(), "3": RowwiseParallel()})
        self.model = model
        self.optimizer = optimizer if optimizer is not None else adamw(model.parameters())
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=7, gamma=0.7)
        self.sampler = ShardedSampler(
            N_SAMPLES, num_replicas=self.dp_size, rank=self.dp_rank, seed=5, drop_unit=GLOBAL_BATCH
        )
        self.state = TrainState(self.sampler)
        self.x, self.y = dataset()
        self.seen: list[int] = []
        torch.manual_seed(100 + seed + (dist.get_rank() if dist.is_initialized() and layout != "single" else 0))

    def components(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "lr_scheduler": self.scheduler,
            "train_state": self.state,
        }

    def manager(self, directory: str, **options: Any) -> CheckpointManager:
        return CheckpointManager(directory, plan=self.plan, dp_size=self.dp_size, dp_rank=self.dp_rank, **options)

    def train_to(
        self, total_steps: int, *, manager: CheckpointManager | None = None, save_every: int = 0
    ) -> list[float]:
        per_rank = GLOBAL_BATCH // self.dp_size
        losses = []
        while self.state.step < total_steps:
            idx = list(self.sampler)[:per_rank]
            if len(idx) < per_rank:
                self.sampler.set_epoch(self.sampler.epoch + 1)
                continue
            self.seen.extend(idx)
            loss = nn.functional.mse_loss(self.model(self.x[idx]), self.y[idx])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.scheduler.step()
            self.sampler.advance(GLOBAL_BATCH)
            self.state.step += 1
            losses.append(loss.item())
            if manager is not None and save_every and self.state.step % save_every == 0:
                manager.save(self.components(), step=self.state.step)
        return losses

    def full_state(self) -> dict[str, torch.Tensor]:
        """Full (gathered) model and optimizer tensors, flat, on every rank."""
        local = local_optimizer(self.optimizer)  # ZeRO-1: this rank's partition, gathered below
        msd, osd = get_state_dict(self.model, [local], options=StateDictOptions(full_state_dict=True))
        state = osd["state"]
        if local is not self.optimizer:
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, state)
            state = {fqn: st for part in parts for fqn, st in part.items()}
        out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
        for fqn, st in sorted(state.items()):
            for key, value in st.items():
                out[f"optim.{fqn}.{key}"] = (
                    value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
                )
        out["lr"] = torch.tensor(self.optimizer.param_groups[0]["lr"])
        return out


def eval_loss(model: nn.Module) -> float:
    x, y = dataset()
    model.eval()
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


class _MiniTrainer:
    """Just enough of the Trainer's surface for CheckpointCallback (used by the subprocess tests)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.should_stop = False

    @property
    def global_step(self) -> int:
        return self.job.state.step

    def stateful_components(self) -> dict[str, Any]:
        return self.job.components()


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.distributed.test_checkpoint_workload --dir D --steps N ...`` (one rank)."""
    import argparse
    import os
    import sys

    from shardwise.checkpoint.callback import CheckpointCallback

    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="single")
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from shardwise.runtime.env import init

        init()  # forms the group; a restarted attempt uses fresh store keys
    job = Job(args.layout, width=args.width)
    manager = job.manager(args.dir, async_save=args.async_save, every_n_steps=args.save_every, keep_last_n=args.keep)
    # A custom loop opts in to SHARDWISE_FAULT explicitly (read once into the runtime's settings).
    from shardwise.checkpoint.faults import Fault
    from shardwise.runtime.detect import detect_process

    settings = detect_process(os.environ).settings
    manager.fault = Fault.for_attempt(settings.fault, settings.restart_count)
    trainer = _MiniTrainer(job)
    callback = CheckpointCallback(manager, resume="auto")
    callback.on_fit_start(trainer)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        print(f"READY resumed={callback.loaded.step if callback.loaded else None}", flush=True)
    committed = manager.last_committed
    while job.state.step < args.steps and not trainer.should_stop:
        losses = job.train_to(job.state.step + 1)
        callback.on_step_end(trainer, {"loss": losses[-1]})
        if manager.last_committed != committed and rank == 0:
            committed = manager.last_committed
            print(f"COMMITTED {committed}", flush=True)  # printed only after the marker is on disk
    callback.on_fit_end(trainer)
    if rank == 0:
        print(f"COMMITTED {manager.last_committed}", flush=True)
    state = job.full_state()
    if args.out and rank == 0:
        torch.save(state, args.out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
