"""Data-parallel Trainer parity: n processes equal one process with the same seed and global batch.

Every optimizer step of n ranks reads the same block of the epoch's permutation as one process
with the full global batch (strided sharding), and DDP averages gradients, so per-step losses and
final weights agree to float32 rounding. The one-process Trainer is itself checked against a
hand-written loop, so both sides cannot be wrong the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.errors import ConfigError
from shardwise.train import DataOptions, LoggingOptions, TrainOptions, Trainer
from tests.helpers import SEED, make_data, make_model, run_fit, sgd


def manual_loop(steps: int = 20, gbs: int = 32) -> dict:
    """The same training written by hand: one process, full global batch, the epoch's permutation."""
    model, data = make_model(), make_data()
    opt = sgd(model.parameters())
    per_epoch = len(data) // gbs
    losses = []
    for s in range(steps):
        epoch, i = divmod(s, per_epoch)
        perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
        idx = perm[i * gbs : (i + 1) * gbs]
        loss = F.cross_entropy(model(data.tensors[0][idx]), data.tensors[1][idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def bad_batch() -> str:
    try:
        Trainer(make_model(), loss_fn=F.cross_entropy, global_batch_size=6, train=TrainOptions(grad_accum_steps=2),
                logging=LoggingOptions(progress_bar=False))
    except ConfigError as exc:
        return str(exc)
    return "no error"


def assert_same(ref: dict, got: dict, rtol: float = 1e-5) -> None:
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=1e-7)
    assert ref["weights"].keys() == got["weights"].keys()
    for key in ref["weights"]:
        torch.testing.assert_close(got["weights"][key], ref["weights"][key], rtol=rtol, atol=1e-6, msg=key)


def test_single_process_trainer_equals_hand_written_loop(pools) -> None:
    got = pools(1).run(run_fit)[0]
    assert got["step"] == 20 and got["epoch"] == 2
    assert_same(manual_loop(), got, rtol=1e-6)


def test_dp_2_and_4_processes_equal_one_process(pools) -> None:
    ref = pools(1).run(run_fit)[0]
    assert ref["losses"][0] > ref["losses"][-1] * 1.5  # it trains: the comparison is not between constants
    for n in (2, 4):
        results = pools(n).run(run_fit)
        for rank, got in enumerate(results):
            assert_same(ref, got)
            assert got["losses"] == results[0]["losses"], f"rank {rank} logged another loss"


def test_grad_accumulation_equals_one_big_batch(pools) -> None:
    one = pools(1)
    big = one.run(run_fit, gbs=32, accum=1)[0]
    assert_same(big, one.run(run_fit, gbs=32, accum=4)[0])  # 4 micro-steps of 8 == 1 step of 32
    assert_same(big, pools(2).run(run_fit, gbs=32, accum=2)[0])  # 2 ranks x 2 micro-steps of 8


def test_clipping_norm_is_global_and_equals_one_process(pools) -> None:
    ref = pools(1).run(run_fit, clip=0.5)[0]
    assert max(ref["norms"]) > 0.5  # clipping is active on some steps
    results = pools(2).run(run_fit, clip=0.5)
    for got in results:
        assert got["norms"] == results[0]["norms"]  # bitwise the same on every rank
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
        assert_same(ref, got)


def test_global_batch_must_divide(pools) -> None:
    messages = pools(2).run(bad_batch)
    assert all("does not split into 2 data-parallel ranks x 2 accumulation steps" in m for m in messages), messages


def test_loader_workers_do_not_change_the_data(pools) -> None:
    """num_workers / persistent workers / pinning only move loading elsewhere: same batches, same run."""
    one = pools(1)
    ref = one.run(run_fit, steps=12)[0]
    # fork: the test ranks are spawned processes, whose default would re-import torch per worker.
    got = one.run(
        run_fit, steps=12, data=DataOptions(num_workers=2, persistent_workers=True, worker_start_method="fork")
    )[0]
    assert got["losses"] == ref["losses"]
