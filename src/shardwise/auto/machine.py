"""Which cluster spec ``Trainer(plan="auto")`` plans with: the one given, else this machine's, measured once, then
cached.

:func:`cluster_spec`: ``cluster=`` (a spec, a preset name or a spec file), else ``SHARDWISE_CLUSTER``
(read once into the runtime's settings), else this machine (:func:`machine_spec`). Before anything
is measured, :func:`device_spec` (this device's memory with preset speeds) tells whether any plan
fits at all: fitting does not depend on speed.

The presets describe hardware from datasheets; what a plan costs *here* (eager overheads, a CPU
host's shared cores, this interconnect) is only known by measuring. So the first ``plan="auto"``
job of a given shape calibrates inside its own world (:func:`calibrate_world`, every rank takes
part, about a minute on a 2-core CPU host, 20 s on one H200) and keeps the spec in a cache file keyed
by host, world size, device, threads per process and torch version; later jobs of that shape read
it. ``shardwise calibrate`` writes the same file. ``SHARDWISE_CLUSTER`` (a preset name or a spec
file) bypasses all of this.

Cache directory: ``$SHARDWISE_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardwise``, else
``~/.cache/shardwise``. Delete a file there (or run ``shardwise calibrate``) to measure again.
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import replace

import torch
import torch.distributed as dist

from shardwise.errors import ConfigError
from shardwise.plan.cluster import ClusterSpec
from shardwise.plan.planner import cluster_for_device, cluster_of
from shardwise.runtime.detect import RuntimeEnv
from shardwise.runtime.logging import get_logger

log = get_logger("train")

ClusterArg = ClusterSpec | str | None

QUICK_COLLECTIVE_SIZES = (64 * 2**10, 2**20, 4 * 2**20)


def cache_path(directory: str, *, world_size: int, device_type: str, threads: int, device_name: str = "") -> str:
    """The cache file of one job shape on this host, in ``directory`` (the runtime settings'
    ``cache_dir``: ``$SHARDWISE_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardwise``, else ``~/.cache/shardwise``)."""
    device = device_type if not device_name else f"{device_type}-{device_name.replace(' ', '_')}"
    name = (
        f"cluster-{socket.gethostname()}-{world_size}x{device}-{threads}t-torch{torch.__version__.split('+')[0]}.json"
    )
    return os.path.join(directory, name)


def load_cached(path: str) -> ClusterSpec | None:
    """The cached spec, or None when missing or unreadable (an old format: measure again)."""
    if not os.path.exists(path):
        return None
    try:
        return ClusterSpec.load(path)
    except ConfigError:
        return None


def save_cached(spec: ClusterSpec, path: str) -> None:
    """Write atomically (a temporary file renamed over the target), so a reader never sees half."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".cluster-", suffix=".json")
    os.close(fd)
    try:
        spec.save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def calibrate_world(*, local_world_size: int | None = None) -> ClusterSpec:
    """Measure the current process group (collective call: every rank) and return its spec.

    Same measurements as ``shardwise calibrate`` (:func:`shardwise.calibrate.calibration.calibrate_worker`)
    with fewer collective message sizes, in the job's own processes and threads, so the figures
    are the ones training will see. ``local_world_size`` sets the devices per node (default: all
    ranks on one node)."""
    # Only plan="auto" without a cluster= measures the machine: the calibration is imported on that path alone.
    from shardwise.calibrate.calibration import calibrate_worker, to_spec

    cal = calibrate_worker(list(QUICK_COLLECTIVE_SIZES), None, 3)
    spec = to_spec(cal)
    n = dist.get_world_size()
    per_node = local_world_size or n
    if n % per_node == 0 and per_node != spec.devices_per_node:
        spec = replace(spec, devices_per_node=per_node)
    return spec


def cluster_spec(env: RuntimeEnv, cluster: ClusterArg) -> ClusterSpec:
    """``cluster`` (a spec, a preset name or a spec file), else ``SHARDWISE_CLUSTER``, else this
    machine's measured spec (see the module doc)."""
    chosen = cluster if cluster is not None else env.settings.cluster
    if chosen is not None:
        return cluster_of(chosen, world_size=env.world_size)
    return machine_spec(env)


def machine_spec(env: RuntimeEnv) -> ClusterSpec:
    """This world's measured cluster spec: the cached calibration of this job shape, or a new one
    measured now by every rank and cached by rank 0."""
    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else ""
    path = cache_path(env.settings.cache_dir, world_size=env.world_size, device_type=env.device.type,
                      threads=torch.get_num_threads(), device_name=name)
    found: list[ClusterSpec | None] = [load_cached(path) if env.rank == 0 else None]
    if dist.is_initialized() and env.world_size > 1:
        dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        if env.is_main:
            log.info("plan=auto: using this machine's calibration %s", path)
        return found[0]
    if env.is_main:
        log.info(
            "plan=auto: measuring this machine once (%d processes, about a minute on a small CPU host); it is cached "
            "in %s",
            env.world_size,
            path,
        )
    spec = calibrate_world(local_world_size=env.local_world_size)
    if env.rank == 0:
        save_cached(spec, path)
    return spec


def device_spec(env: RuntimeEnv) -> ClusterSpec:
    """This device's preset with the memory the calibration would measure (a GPU's total memory,
    else the host's memory shared by its local processes): enough to tell whether any plan fits,
    before the machine's speed is measured."""
    if env.device.type == "cuda":
        props = torch.cuda.get_device_properties(env.device)
        return cluster_for_device(
            "cuda", world_size=env.world_size, device_name=props.name, memory_bytes=float(props.total_memory)
        )
    memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / max(1, env.local_world_size)
    return replace(cluster_for_device(env.device.type, world_size=env.world_size), memory_bytes=memory)
