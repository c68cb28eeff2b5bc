"""One micro-step: the Trainer and ``shardwise verify`` run the same forward-backward
(:mod:`shardwise.parallel.micro_step`), so a defect injected there reaches the Trainer and fails
the parity engine, while the code as it is passes. And a comparison of nothing cannot pass."""

from __future__ import annotations

import pickle

import pytest
import torch

from shardwise.models.gpt import GPTConfig
from shardwise.parallel import micro_step
from shardwise.verify.parity import GPTWorkload, ParityReport, Run, ScriptWorkload, Training, _rel, parity_worker
from tests.helpers import run_fit

WORKLOAD = GPTWorkload(GPTConfig(vocab_size=32, seq_len=8, layers=2, hidden=16, heads=2))
ORIGINAL = micro_step._backward


def _halved(loss, weight, loss_scale):
    """The loss weighting off by a factor of 2."""
    ORIGINAL(loss, weight * 0.5, loss_scale)


class _DropSecond:
    """Every second micro-batch's gradient dropped (its backward never runs)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, loss, weight, loss_scale):
        self.calls += 1
        if self.calls % 2:
            ORIGINAL(loss, weight, loss_scale)


class _Count:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, loss, weight, loss_scale):
        self.calls += 1
        ORIGINAL(loss, weight, loss_scale)


def _verify_under(defect: str | None) -> tuple[bool, str]:
    """``shardwise verify``'s engine (dp=2, 2 micro-steps per rank, ragged token masks) with the
    micro-step's backward replaced by ``defect`` in this process."""
    micro_step._backward = {None: ORIGINAL, "halved": _halved, "dropped": _DropSecond()}[defect]
    try:
        [report] = parity_worker(WORKLOAD, [Run("dp=2", accumulation=2)], Training(steps=3, global_batch=8))
    finally:
        micro_step._backward = ORIGINAL
    return report.passed(1e-5), report.format(1e-5)


def _trainer_backwards() -> int:
    """How many backwards the Trainer ran through the shared micro-step (2 steps x 2 micro-batches)."""
    counter = _Count()
    micro_step._backward = counter
    try:
        run_fit(steps=2, gbs=8, accum=2)
    finally:
        micro_step._backward = ORIGINAL
    return counter.calls


@pytest.mark.timeout(240)
def test_a_defect_in_the_micro_step_fails_verify_and_reaches_the_trainer(dist2):
    for passed, text in dist2.run(_verify_under, None):
        assert passed, text
    for defect in ("halved", "dropped"):
        for passed, text in dist2.run(_verify_under, defect):
            assert not passed and "FAIL" in text, (defect, text)
    assert dist2.run(_trainer_backwards) == [4, 4]


def test_a_comparison_of_vanished_gradients_does_not_pass():
    """Zero gradients on both sides (a plan that trains nothing) match perfectly and prove nothing."""
    still = ParityReport(
        plan="dp=2",
        losses=(1.0, 1.0),
        ref_losses=(1.0, 1.0),
        grad_norms=(0.0, 0.0),
        ref_grad_norms=(0.0, 0.0),
        weight_diffs={"w": 0.0},
        ref_moved=0.0,
    )
    assert not still.reference_moved and not still.passed(1e-5)
    assert "did not train" in still.format(1e-5)
    assert _rel(0.0, 0.0) == float("inf") and _rel(1.0, 1.0) == 0.0
    moved = ParityReport(
        plan="dp=2",
        losses=(1.0, 0.9),
        ref_losses=(1.0, 0.9),
        grad_norms=(0.5, 0.4),
        ref_grad_norms=(0.5, 0.4),
        weight_diffs={"w": 0.0},
        ref_moved=0.1,
    )
    assert moved.passed(1e-5)
    nan = ParityReport(plan="dp=2", losses=(1.0, float("nan")), ref_losses=(1.0, 0.9), grad_norms=(0.5, 0.4),
                       ref_grad_norms=(0.5, 0.4), weight_diffs={"w": 0.0}, ref_moved=0.1)
    assert not nan.passed(1e-5) and nan.loss_diff != nan.loss_diff  # a NaN late in the run is not hidden by max()


def test_the_reference_records_that_it_moved():
    from shardwise.verify.parity import run_reference

    batches = [WORKLOAD.batch(step, 4) for step in range(2)]
    assert run_reference(WORKLOAD, batches, Training(steps=2, global_batch=4)).moved > 0
    assert run_reference(WORKLOAD, batches, Training(steps=2, global_batch=4, lr=0.0)).moved == 0.0


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _verify_with_adamw() -> tuple[bool, str, dict[str, int]]:
    [report] = parity_worker(
        WORKLOAD, [Run("dp=2", accumulation=2)], Training(steps=3, global_batch=8, optimizer=adamw)
    )
    return report.passed(1e-5), report.format(1e-5), report.memory


@pytest.mark.timeout(240)
def test_verify_runs_the_users_optimizer_factory(dist2):
    """The user's AdamW (as Trainer(optimizer=...) takes it) passes on a correct plan: Adam's
    scale-invariant update amplifies float32 rounding (the key bias's noise gradient), so the
    weights have their own tolerance; loss and grad norm keep rtol."""
    for passed, text, memory in dist2.run(_verify_with_adamw):
        assert passed and "tolerance 0.01: an adaptive optimizer" in text, text
        assert memory["optim"] == 2 * memory["param"]  # AdamW's two moments per parameter: it really ran


def test_a_script_names_its_optimizer(tmp_path):
    script = tmp_path / "model.py"
    script.write_text(
        "import torch\n"
        "def build_model(seed):\n    return torch.nn.Linear(2, 2)\n"
        "def make_batch(step, size):\n    return torch.zeros(size, 2), torch.zeros(size, dtype=torch.long)\n"
        "def make_optimizer(params):\n    return torch.optim.Adagrad(params, lr=0.5)\n"
    )
    factory = ScriptWorkload(str(script)).optimizer()
    assert isinstance(factory(torch.nn.Linear(2, 2).parameters()), torch.optim.Adagrad)
    assert pickle.loads(pickle.dumps(factory)) == factory  # it reaches the spawned processes
    bare = tmp_path / "bare.py"
    bare.write_text("def build_model(seed):\n    return None\ndef make_batch(step, size):\n    return None\n")
    assert ScriptWorkload(str(bare)).optimizer() is None
