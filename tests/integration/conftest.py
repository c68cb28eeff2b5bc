"""A real OpenSSH server on loopback for the multi-host launcher tests, shared by the session.

The ``sshd`` fixture installs the OpenSSH server when it is missing (``apt-get install
openssh-server``, as CI runs ``make test`` as root on a fresh Debian machine), makes a throwaway
host key and user key in a temporary directory, and starts ``sshd`` in the foreground as the
current user with its own configuration: loopback only, a free port, public-key login with that
key only, no PAM, no strict modes. Tests reach it through an ssh client configuration file
(``shardwise run --ssh-config FILE``) in which the "hosts" ``127.0.0.1`` and ``localhost`` point at
that port, so nothing of the user's own ssh set-up is read or changed. The test is skipped (with
the reason) only where the server can be neither found nor installed.

``hf_zygote``: for the Hugging Face CLI tests, a process that imported torch, shardwise and
transformers once, from which their commands fork (:func:`tests.forkrun.shardwise_command`).
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import pytest

from tests.checkout import stop

if TYPE_CHECKING:
    from tests.forkrun import Zygote

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/usr/bin/sshd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _find_sshd() -> str | None:
    found = shutil.which("sshd")
    return found or next((c for c in SSHD_CANDIDATES if os.access(c, os.X_OK)), None)


def _install_sshd() -> str:
    """apt-get install openssh-server, without letting the package start a system sshd."""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("the OpenSSH server (sshd) is not installed and cannot be installed here (needs root and apt-get): "
                    "apt-get install openssh-server")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    policy = Path("/usr/sbin/policy-rc.d")  # Debian's switch that keeps maintainer scripts from starting services
    made_policy = not policy.exists()
    if made_policy:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=120",
               "openssh-server", "openssh-client"]
    try:
        done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=240)
        if done.returncode != 0:  # a fresh machine may have no package lists yet
            subprocess.run(
                ["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=120"], env=env, capture_output=True, timeout=240
            )
            done = subprocess.run(install, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.skip("installing openssh-server timed out")
    finally:
        if made_policy:
            policy.unlink(missing_ok=True)
    found = _find_sshd()
    if found is None or not shutil.which("ssh"):
        pytest.skip(f"apt-get install openssh-server failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return found


@dataclass(frozen=True)
class LoopbackSshd:
    """The running server and how to reach it."""

    port: int
    user: str
    key: Path
    config: Path  # ssh client configuration: "127.0.0.1" and "localhost" reach this server
    dir: Path

    def config_with(self, aliases: dict[str, int], name: str = "ssh_config_extra") -> Path:
        """A client configuration that also has ``alias -> 127.0.0.1:port`` entries (dead ports)."""
        path = self.dir / name
        blocks = [self.config.read_text()]
        for alias, port in aliases.items():
            blocks.append(_host_block(alias, port, self.user, self.key, hostname="127.0.0.1"))
        path.write_text("\n".join(blocks))
        return path


def _host_block(patterns: str, port: int, user: str, key: Path, hostname: str | None = None) -> str:
    lines = [f"Host {patterns}"] + ([f"    HostName {hostname}"] if hostname else []) + [
        f"    Port {port}",
        f"    User {user}",
        f"    IdentityFile {key}",
        "    IdentitiesOnly yes",
        "    StrictHostKeyChecking no",
        "    UserKnownHostsFile /dev/null",
        "    LogLevel ERROR",
    ]
    return "\n".join(lines) + "\n"


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True, capture_output=True, timeout=60
    )


@pytest.fixture(scope="session")
def sshd() -> Iterator[LoopbackSshd]:
    have_client = shutil.which("ssh") and shutil.which("ssh-keygen")
    sshd_path = _find_sshd() if have_client else None
    sshd_path = sshd_path or _install_sshd()  # the server package brings the client with it
    work = Path(tempfile.mkdtemp(prefix="shardwise-sshd-"))
    _keygen(work / "host_key")
    _keygen(work / "user_key")
    shutil.copy(work / "user_key.pub", work / "authorized_keys")
    user = getpass.getuser()
    port = free_port()
    (work / "sshd_config").write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {work / 'host_key'}",
                f"AuthorizedKeysFile {work / 'authorized_keys'}",
                f"PidFile {work / 'sshd.pid'}",
                "StrictModes no",
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PubkeyAuthentication yes",
                "PermitRootLogin prohibit-password",
                "PrintMotd no",
                "MaxStartups 100:30:200",
                "MaxSessions 100",
                "LogLevel ERROR",
            ]
        )
        + "\n"
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    log = open(work / "sshd.log", "w")
    server = subprocess.Popen(
        [sshd_path, "-D", "-e", "-f", str(work / "sshd_config")], stdout=log, stderr=subprocess.STDOUT
    )
    config = work / "ssh_config"
    config.write_text(_host_block("127.0.0.1 localhost", port, user, work / "user_key"))
    try:
        deadline = time.monotonic() + 30
        while True:
            check = subprocess.run(
                ["ssh", "-F", str(config), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "127.0.0.1", "true"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if check.returncode == 0:
                break
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"the test sshd does not accept logins: {check.stderr.strip()} / sshd log: "
                    f"{(work / 'sshd.log').read_text()}"
                )
            time.sleep(0.3)
        yield LoopbackSshd(port=port, user=user, key=work / "user_key", config=config, dir=work)
    finally:
        stop(server)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def elastic_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The per-step losses of the node-loss job (tests/integration/nodes_harness.py) run as one
    uninterrupted process: the reference of every node-loss test, computed once."""
    from tests.integration.nodes_harness import SAVE_EVERY, STEPS, reference

    return reference(tmp_path_factory.mktemp("elastic-reference"), steps=STEPS, save_every=SAVE_EVERY)


@pytest.fixture(scope="module")
def hf_zygote() -> Iterator["Zygote"]:
    from tests.forkrun import Zygote

    server = Zygote(preload=("shardwise.jobs.hf_train", "shardwise.checkpoint.hf_export", "transformers", "tokenizers"))
    yield server
    server.close()
