"""This machine's cluster spec for ``Trainer(plan="auto")``: measured once, then cached.

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

from shardwise.calibrate.calibration import calibrate_worker, to_spec
from shardwise.errors import ConfigError
from shardwise.plan.cluster import ClusterSpec

QUICK_COLLECTIVE_SIZES = (64 * 2**10, 2**20, 4 * 2**20)


def cache_path(directory: str, *, world_size: int, device_type: str, threads: int, device_name: str = "") -> str:
    """The cache file of one job shape on this host, in ``directory`` (the runtime settings'
    ``cache_dir``: ``$SHARDWISE_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardwise``, else ``~/.cache/shardwise``)."""
    import torch

    device = device_type if not device_name else f"{device_type}-{device_name.replace(' ', '_')}"
    name = f"cluster-{socket.gethostname()}-{world_size}x{device}-{threads}t-torch{torch.__version__.split('+')[0]}.json"
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
    import torch.distributed as dist


    cal = calibrate_worker(list(QUICK_COLLECTIVE_SIZES), None, 3)
    spec = to_spec(cal)
    n = dist.get_world_size()
    per_node = local_world_size or n
    if n % per_node == 0 and per_node != spec.devices_per_node:
        spec = replace(spec, devices_per_node=per_node)
    return spec
