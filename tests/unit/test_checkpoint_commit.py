"""The commit protocol on its own: markers, verification, the latest pointer and retention."""

from __future__ import annotations

import json
import os

import pytest

from shardwise.checkpoint import commit as cm


def _fake_step(
    root: str, step: int, *, committed: bool = True, metrics: dict | None = None, payload: bytes = b"x" * 100
) -> str:
    path = os.path.join(root, cm.step_dirname(step))
    os.makedirs(os.path.join(path, "ranks"), exist_ok=True)
    for name in ("__0_0.distcp", ".metadata", "ranks/rank_00000.pt"):
        with open(os.path.join(path, name), "wb") as f:
            f.write(payload + str(step).encode())
    if committed:
        cm.commit(path, step=step, world_size=2, dp_size=2, plan="dp=2", metrics=metrics or {})
        cm.update_latest(root, step)
    return path


def test_marker_lists_every_file_with_size_and_checksum(tmp_path):
    path = _fake_step(str(tmp_path), 10)
    marker = cm.read_marker(path)
    assert marker is not None and marker.step == 10 and marker.plan == "dp=2"
    assert sorted(marker.files) == [".metadata", "__0_0.distcp", "ranks/rank_00000.pt"]
    assert all(len(f["sha256"]) == 64 and f["size"] == 102 for f in marker.files.values())
    assert open(os.path.join(str(tmp_path), cm.LATEST)).read().strip() == "step_00000010"


def test_uncommitted_truncated_and_corrupt_checkpoints_are_ignored(tmp_path):
    root = str(tmp_path)
    _fake_step(root, 10)
    _fake_step(root, 20)
    _fake_step(root, 30, committed=False)  # crashed before the marker
    assert cm.latest_complete(root).step == 20
    with open(os.path.join(root, "step_00000020", "__0_0.distcp"), "r+b") as f:
        f.write(b"y")  # same size, different bytes
    assert cm.verify(os.path.join(root, "step_00000020"), level="size")[0] is not None
    assert "checksum" in cm.verify(os.path.join(root, "step_00000020"), level="checksum")[1]
    assert cm.latest_complete(root).step == 10
    os.truncate(os.path.join(root, "step_00000010", ".metadata"), 3)
    assert "bytes" in cm.verify(os.path.join(root, "step_00000010"), level="size")[1]
    assert cm.latest_complete(root) is None
    with open(os.path.join(root, "step_00000030", cm.MARKER), "w") as f:
        f.write("{not json")  # a torn marker write is no marker
    assert cm.read_marker(os.path.join(root, "step_00000030")) is None


def test_latest_pointer_is_not_trusted_over_markers(tmp_path):
    root = str(tmp_path)
    _fake_step(root, 10)
    cm.update_latest(root, 99)  # e.g. a pointer from a crashed later save
    assert cm.latest_complete(root).step == 10


def test_retention_keeps_last_n_and_best_and_never_the_newest(tmp_path):
    root = str(tmp_path)
    losses = {10: 0.5, 20: 0.1, 30: 0.4, 40: 0.3, 50: 0.45}
    for step, loss in losses.items():
        _fake_step(root, step, metrics={"val_loss": loss})
    _fake_step(root, 5, committed=False)  # crash leftover, older than the newest complete: removed
    _fake_step(root, 60, committed=False)  # maybe in flight: kept
    deleted = cm.retain(root, keep_last_n=2, keep_best=("val_loss", "min"))
    assert sorted(deleted) == [5, 10, 30]
    left = [c.step for c in cm.list_checkpoints(root, level="none")]
    assert left == [20, 40, 50, 60]
    assert cm.retain(root, keep_last_n=1, keep_best=("val_loss", "max")) == [20, 40]  # 50: newest and best by max
    assert cm.latest_complete(root).step == 50


def test_removal_drops_the_marker_first(tmp_path, monkeypatch):
    path = _fake_step(str(tmp_path), 10)
    monkeypatch.setattr(cm.shutil, "rmtree", lambda *a, **k: None)  # a crash right after the marker is gone
    cm.remove_checkpoint(path)
    assert os.path.isdir(path) and cm.latest_complete(str(tmp_path)) is None


def test_marker_json_is_readable(tmp_path):
    path = _fake_step(str(tmp_path), 7, metrics={"loss": 1.5})
    data = json.load(open(os.path.join(path, cm.MARKER)))
    assert data["step"] == 7 and data["metrics"] == {"loss": 1.5} and data["version"] == cm.FORMAT_VERSION


@pytest.mark.parametrize("level", ["none", "size", "checksum"])
def test_list_checkpoints_empty_dir(tmp_path, level):
    assert cm.list_checkpoints(str(tmp_path / "missing"), level=level) == []
