"""What ``shardwise doctor`` reports about this machine before it starts any process.

Versions, devices, backends and the environment variables that decide how processes meet, with
a warning for each known pitfall (an interface name that does not exist, an address that does not
resolve, stale rank variables exported in the shell).
"""

from __future__ import annotations

import os
import platform
import socket
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

RELEVANT_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
    "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "SLURM_JOB_ID", "SLURM_JOB_NODELIST",
    "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
    "SHARDWISE_HANG_TIMEOUT", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DESYNC_DEBUG",
    "TORCH_DISTRIBUTED_DEBUG",
)


@dataclass(frozen=True)
class Report:
    facts: tuple[tuple[str, str], ...]
    env: tuple[tuple[str, str], ...]
    warnings: tuple[str, ...]


def _interfaces() -> set[str]:
    try:
        return {name for _, name in socket.if_nameindex()}
    except OSError:
        return set()


def check_ifname(var: str, value: str, interfaces: set[str]) -> str | None:
    """NCCL/Gloo accept a comma list of interface prefixes, '^' to exclude and '=' for exact names."""
    if not value or value.startswith("^") or not interfaces:
        return None
    wanted = [w.strip() for w in value.split(",") if w.strip()]
    for w in wanted:
        exact = w.startswith("=")
        name = w.lstrip("=")
        if any(i == name if exact else i.startswith(name) for i in interfaces):
            return None
    return (f"{var}={value} names no interface on this host (have: {', '.join(sorted(interfaces))}); "
            f"processes will fail to connect: unset it or name an existing interface")


def collect(environ: Mapping[str, str]) -> Report:
    facts = [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("platform", platform.platform()),
        ("cpu cores", str(os.cpu_count())),
        ("cuda", torch.version.cuda or "not built in"),
        ("gpus", str(torch.cuda.device_count()) if torch.cuda.is_available() else "0"),
    ]
    if torch.cuda.is_available():
        facts.append(("nccl", ".".join(map(str, torch.cuda.nccl.version()))))
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            facts.append((f"gpu {i}", f"{prop.name}, {prop.total_memory / 2**30:.0f} GiB"))
    backends = [
        name
        for name, ok in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if ok
    ]
    facts.append(("backends", ", ".join(backends) or "none"))
    try:
        from shardwise.version import __version__

        facts.append(("shardwise", __version__))
    except ImportError:
        pass

    warnings = []
    interfaces = _interfaces()
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        msg = check_ifname(var, environ.get(var, ""), interfaces)
        if msg:
            warnings.append(msg)
    addr = environ.get("MASTER_ADDR")
    if addr:
        try:
            socket.getaddrinfo(addr, None)
        except socket.gaierror:
            warnings.append(
                f"MASTER_ADDR={addr} does not resolve: ranks cannot meet; use an IP or a resolvable host name"
            )
    if "RANK" in environ and "TORCHELASTIC_RUN_ID" not in environ:
        warnings.append(
            "RANK is exported in this shell: a plain 'python train.py' will think it is one rank of a larger job; "
            "unset RANK and WORLD_SIZE"
        )
    if environ.get("NCCL_P2P_DISABLE") == "1":
        warnings.append("NCCL_P2P_DISABLE=1 forces GPU traffic through host memory and slows intra-node collectives")
    hang = environ.get("SHARDWISE_HANG_TIMEOUT", "").strip().lower()
    if hang and hang not in ("off", "none", "false", "no"):
        try:
            if float(hang) < 0:
                raise ValueError
        except ValueError:
            warnings.append(
                f"SHARDWISE_HANG_TIMEOUT={hang} is not a non-negative number of seconds: init() will refuse it"
            )
    if not dist.is_available():
        warnings.append("this torch build has no torch.distributed")
    kernel_facts, kernel_warnings = torchao_kernels(cuda=torch.cuda.is_available())
    facts += kernel_facts
    warnings += kernel_warnings
    env = tuple((k, environ[k]) for k in RELEVANT_VARS if k in environ)
    return Report(tuple(facts), env, tuple(warnings))


def torchao_kernels(*, cuda: bool) -> tuple[list[tuple[str, str]], list[str]]:
    """torchao's optional kernel libraries (``torchao/_C*.so``), loaded as torchao loads them at
    import (whose "Failed to load" lines shardwise keeps off the terminal, :mod:`shardwise.runtime.quiet`):
    a fact line, and with a GPU a warning per library that does not load (its fast FP8/MX kernels
    are missing). Nothing without torchao."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torchao")
    if spec is None or not spec.submodule_search_locations:
        return [], []
    libraries = sorted(p for d in spec.submodule_search_locations for p in Path(d).glob("_C*.so"))
    failed = []
    for path in libraries:
        try:
            torch.ops.load_library(str(path))
        except Exception as exc:  # noqa: BLE001 - any failure means the kernels are not there
            failed.append((path.name, (str(exc).strip().splitlines() or [type(exc).__name__])[0]))
    if not failed:
        return [("torchao kernels", f"{len(libraries)} loaded" if libraries else "none shipped")], []
    names = ", ".join(name for name, _ in failed)
    fact = f"{len(failed)} of {len(libraries)} do not load ({names})" + (
        "" if cuda else ": they are GPU kernels, not needed on this CPU machine"
    )
    warned = (
        [
            f"torchao's {name} does not load ({why}): its fast FP8/MX kernels are missing (torchao's MX formats and "
            "CUTLASS GEMMs need them; precision=fp8's float8 linears run on torch's own _scaled_mm); install the "
            "torchao build that matches this torch, Python and CUDA"
            for name, why in failed
        ]
        if cuda
        else []
    )
    return [("torchao kernels", fact)], warned


def format_report(report: Report) -> str:
    width = max(len(k) for k, _ in report.facts + report.env) if report.facts else 10
    lines = [f"{k:<{width}}  {v}" for k, v in report.facts]
    lines.append("environment:" if report.env else "environment: (none of the variables that matter is set)")
    lines += [f"  {k}={v}" for k, v in report.env]
    lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)
