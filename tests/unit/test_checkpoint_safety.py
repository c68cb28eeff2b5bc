"""Single-process checks of the manager: safety (no unpickling, mismatch errors), async copies,
faults, signals, consolidation and the CLI."""

from __future__ import annotations

import os
import pickle
import signal

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from shardwise.checkpoint import CheckpointManager, Fault
from shardwise.checkpoint import commit as cm
from shardwise.checkpoint.callback import CheckpointCallback
from shardwise.checkpoint.consolidate import consolidate
from shardwise.checkpoint.faults import InjectedFault
from shardwise.checkpoint.safe_io import SafeFileSystemReader
from shardwise.checkpoint.signals import PreemptionSignal
from shardwise.cli import main as cli_main
from shardwise.errors import ConfigError
from tests.distributed.test_checkpoint_workload import Job, eval_loss, make_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _saved(tmp_path, steps=(3,), **options) -> tuple[Job, CheckpointManager]:
    job = Job("single")
    manager = job.manager(str(tmp_path), **options)
    for step in steps:
        job.train_to(step)
        manager.save(job.components(), step=step)
    manager.wait()
    return job, manager


def test_other_model_fails_listing_mismatches_and_changes_nothing(tmp_path):
    _saved(tmp_path)
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 4), nn.Linear(4, 4))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    optimizer = torch.optim.AdamW(other.parameters())
    with pytest.raises(ConfigError) as err:
        CheckpointManager(str(tmp_path)).load({"model": other, "optimizer": optimizer})
    message = str(err.value)
    assert "shape of 0.weight: checkpoint (32, 8), model (16, 8)" in message
    assert "missing in checkpoint: 4.weight (4, 4)" in message and "nothing was modified" in message
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert not optimizer.state


def test_metadata_pickle_with_foreign_globals_is_refused(tmp_path):
    _saved(tmp_path)
    step_dir = cm.latest_complete(str(tmp_path)).path

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with open(os.path.join(step_dir, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(ConfigError, match="refers to posix.system|refers to os.system"):
        SafeFileSystemReader(step_dir).read_metadata()


def test_per_rank_files_load_with_weights_only(tmp_path):
    _saved(tmp_path)
    step_dir = cm.latest_complete(str(tmp_path)).path
    payload = torch.load(os.path.join(step_dir, "ranks", "rank_00000.pt"), weights_only=True)
    assert payload["components"]["train_state"]["step"] == 3


def test_async_save_writes_a_snapshot_not_the_live_tensors(tmp_path):
    job = Job("single", width=20_000)
    manager = job.manager(str(tmp_path), async_save=True)
    job.train_to(1)
    snapshot = {k: v.clone() for k, v in job.model.state_dict().items()}
    manager.save(job.components(), step=1)
    with torch.no_grad():  # training goes on while the files are written
        for p in job.model.parameters():
            p.add_(1.0)
    manager.wait()
    fresh = Job("single", seed=5, width=20_000)
    fresh.manager(str(tmp_path)).load(fresh.components())
    assert all(torch.equal(snapshot[k], v) for k, v in fresh.model.state_dict().items())


def test_policy_and_retention_through_the_callback(tmp_path):
    job = Job("single")
    manager = job.manager(str(tmp_path), every_n_steps=2, keep_last_n=2)

    class T:
        should_stop = False
        global_step = property(lambda self: job.state.step)
        stateful_components = staticmethod(job.components)

    trainer = T()
    callback = CheckpointCallback(manager, resume="auto")
    callback.on_fit_start(trainer)
    assert callback.loaded is None
    for _ in range(5):
        job.train_to(job.state.step + 1)
        callback.on_step_end(trainer, {"loss": 1.0})
    callback.on_fit_end(trainer)  # saves the final step 5
    assert [c.step for c in cm.list_checkpoints(str(tmp_path)) if c.complete] == [4, 5]


def test_sigterm_saves_then_stops(tmp_path):
    job = Job("single")
    manager = job.manager(str(tmp_path), every_n_steps=100)

    class T:
        should_stop = False
        global_step = property(lambda self: job.state.step)
        stateful_components = staticmethod(job.components)

    trainer = T()
    callback = CheckpointCallback(manager, resume=None)
    callback.on_fit_start(trainer)
    try:
        job.train_to(2)
        os.kill(os.getpid(), signal.SIGTERM)
        callback.on_step_end(trainer, {})
    finally:
        callback.on_fit_end(trainer)
    assert trainer.should_stop and callback.preempted
    assert cm.latest_complete(str(tmp_path)).step == 2
    assert signal.getsignal(signal.SIGTERM) is not callback.signal._handle


def test_preemption_signal_restores_handlers():
    previous = signal.getsignal(signal.SIGUSR1)
    with PreemptionSignal() as s:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert s.requested and s.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is previous


def test_fault_spec_parsing_and_firing():
    fault = Fault.parse("rank=1,step=5,at=save,how=raise")
    assert fault == Fault(rank=1, step=5, at="save", how="raise")
    assert Fault.for_attempt("rank=0,step=2", 0) == Fault(rank=0, step=2)
    assert Fault.for_attempt("rank=0,step=2", 1) is None  # a restarted attempt replays the step unharmed
    assert Fault.for_attempt("rank=0,step=2,restart=1", 1) == Fault(rank=0, step=2, restart=1)
    assert Fault.for_attempt("", 0) is None
    fault.maybe_fire(rank=0, step=5, at="save")  # another rank: nothing
    fault.maybe_fire(rank=1, step=4, at="save")  # another step: nothing
    fault.maybe_fire(rank=1, step=5, at="step")  # another place: nothing
    with pytest.raises(InjectedFault):
        fault.maybe_fire(rank=1, step=5, at="save")
    for bad in ("rank=1", "rank=x,step=2", "rank=1,step=2,at=never", "step"):
        with pytest.raises(ConfigError):
            Fault.parse(bad)


def test_fault_during_save_leaves_previous_checkpoint(tmp_path):
    job, manager = _saved(tmp_path, steps=(2,))
    manager.fault = Fault(rank=0, step=4, at="save", how="raise")
    job.train_to(4)
    with pytest.raises(InjectedFault):
        manager.save(job.components(), step=4)
    assert cm.latest_complete(str(tmp_path)).step == 2
    assert not cm.verify(os.path.join(str(tmp_path), "step_00000004"))[0]


def test_consolidated_safetensors_reproduce_eval_loss_exactly(tmp_path):
    job, _ = _saved(tmp_path, steps=(4,))
    out = str(tmp_path / "model.safetensors")
    shapes = consolidate(str(tmp_path), out)
    assert shapes == {k: tuple(v.shape) for k, v in job.model.state_dict().items()}
    plain = make_model(seed=9)
    plain.load_state_dict(load_file(out))
    assert eval_loss(plain) == eval_loss(job.model)


def test_cli_inspect_and_consolidate(tmp_path, capsys):
    _saved(tmp_path, steps=(2, 3))
    os.makedirs(tmp_path / "step_00000009")  # an interrupted save
    assert cli_main(["checkpoint", "inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "INCOMPLETE" in text and "complete" in text and "model.0.weight" in text and "[32, 8]" in text
    assert cli_main(["checkpoint", "consolidate", str(tmp_path), str(tmp_path / "m.safetensors"), "--step", "2"]) == 0
    assert set(load_file(str(tmp_path / "m.safetensors"))) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert cli_main(["checkpoint", "consolidate", str(tmp_path / "nothing"), str(tmp_path / "x.safetensors")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


class _Counter:
    """A Stateful that is not a model: the only component of a model-less checkpoint."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_components_without_a_model_save_and_load(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    assert manager.save({"counter": _Counter(7)}, step=1)
    restored = _Counter(0)
    loaded = CheckpointManager(str(tmp_path)).load({"counter": restored})
    assert loaded is not None and loaded.step == 1 and restored.value == 7
    with pytest.raises(ConfigError, match="an optimizer is checkpointed without its model"):
        manager.save({"optimizer": torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)}, step=2)


def replace_with_pickle_bomb(step_dir: str, rel: str, marker_file: str) -> None:
    """Replace ``rel`` by a pickle whose loading would create ``marker_file``, and rewrite the commit
    marker's size and checksum to match, as an attacker with write access would."""

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker_file}",))

    target = os.path.join(step_dir, rel)
    with open(target, "wb") as f:
        pickle.dump(Evil(), f)
    marker = cm.read_marker(step_dir)
    files = {**marker.files, rel: {"size": os.path.getsize(target), "sha256": cm._sha256(target)}}
    cm.atomic_write_text(os.path.join(step_dir, cm.MARKER), cm.Marker(**{**marker.__dict__, "files": files}).to_json())
    assert cm.verify(step_dir)[0] is not None  # the checksums no longer help


@pytest.mark.parametrize("rel", ["__0_0.distcp", "ranks/rank_00000.pt"])
def test_replaced_file_with_matching_checksum_is_refused_in_one_line(tmp_path, rel):
    _saved(tmp_path / "ckpt")
    step_dir = cm.latest_complete(str(tmp_path / "ckpt")).path
    pwned = str(tmp_path / "pwned")
    replace_with_pickle_bomb(step_dir, rel, pwned)
    fresh = Job("single", seed=5)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        fresh.manager(str(tmp_path / "ckpt")).load(fresh.components())
    message = str(err.value)
    assert f"checkpoint file {os.path.join(step_dir, rel)} " in message and "it was not loaded" in message
    assert "\n" not in message and "weights_only" not in message
    assert not os.path.exists(pwned)
    assert all(torch.equal(before[k], v) for k, v in fresh.model.state_dict().items())


def test_inspect_lists_steps_despite_a_damaged_latest_pointer(tmp_path):
    """``latest`` is a convenience (the markers are the truth): unreadable, it must not stop the listing."""
    from shardwise.checkpoint.inspect import report

    _saved(tmp_path, steps=(2,))
    os.remove(tmp_path / cm.LATEST)
    os.mkdir(tmp_path / cm.LATEST)
    text = report(str(tmp_path))
    assert "(latest -> ?)" in text and "complete" in text
