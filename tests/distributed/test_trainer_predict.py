"""``Trainer.predict`` under sharded plans equals one process: the logits of every sample, in
dataset order, on rank 0 (13 samples, so the data-parallel shards differ in length and the last
batch is partial), and the same outputs when each shard is written to a file instead; under
context parallelism each rank's zig-zag chunks are put back into whole sequences, and evaluation
of a model that has not trained yet equals one process's too."""

from __future__ import annotations

import glob
import os

import torch
from torch.utils.data import TensorDataset

N, SEQ, VOCAB = 13, 8, 16


def _data() -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (N, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def predict_under(plan: str, output_dir: str | None = None, evaluate: bool = False) -> dict:
    import torch.distributed as dist

    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.train import LoggingOptions, TrainOptions, Trainer

    model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=2, hidden=16, heads=2), seed=5)
    trainer = Trainer(model, loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1), plan=plan, global_batch_size=4,
                      train=TrainOptions(seed=1), logging=LoggingOptions(progress_bar=False))
    loss = trainer.evaluate(_data())["loss"] if evaluate else None  # before any step: a fresh model
    out = trainer.predict(_data(), batch_size=3, output_dir=output_dir)
    return {"out": out, "rank": dist.get_rank() if dist.is_initialized() else 0, "plan": trainer.plan, "loss": loss}


def test_predict_gathers_in_order_under_dp_tp_pp(pools, tmp_path) -> None:
    ref = pools(1).run(predict_under, "dp")[0]["out"]
    assert ref.shape == (N, SEQ, VOCAB)
    for nprocs, plan in [(2, "dp=2"), (2, "tp=2"), (2, "pp=2"), (4, "dp=2,pp=2,schedule=gpipe")]:
        results = pools(nprocs).run(predict_under, plan)
        assert all(r["out"] is None for r in results if r["rank"] != 0), plan
        torch.testing.assert_close(results[0]["out"], ref, rtol=1e-5, atol=1e-6, msg=plan)

    # written instead of gathered: one file per data-parallel shard, together every sample once
    out_dir = str(tmp_path / "pred")
    assert all(r["out"] is None for r in pools(4).run(predict_under, "dp=2,tp=2", out_dir))
    files = sorted(glob.glob(os.path.join(out_dir, "*.pt")))
    assert [os.path.basename(f) for f in files] == ["predictions-00000-of-00002.pt", "predictions-00001-of-00002.pt"]
    seen = {}
    for f in files:
        part = torch.load(f, weights_only=True)
        for i, row in zip(part["indices"].tolist(), torch.cat(part["outputs"])):
            seen[i] = row
    assert sorted(seen) == list(range(N))
    torch.testing.assert_close(torch.stack([seen[i] for i in range(N)]), ref, rtol=1e-5, atol=1e-6)


def test_predict_under_zero3_equals_one_process(pools) -> None:
    """ZeRO-3 holds each parameter in halves and all-gathers it inside every forward, so the two
    ranks must run equally many forwards although their shards (7 and 6 samples, batches of 3)
    differ in length; rank 0 gathers every sample in dataset order."""
    ref = pools(1).run(predict_under, "dp")[0]["out"]
    results = pools(2).run(predict_under, "zero=3,dp=2")
    assert [r["rank"] for r in results] == [0, 1] and results[1]["out"] is None
    assert (results[0]["plan"].zero, results[0]["plan"].shard) == (3, 2)
    torch.testing.assert_close(results[0]["out"], ref, rtol=1e-5, atol=1e-6)


def test_predict_and_evaluate_under_context_parallel_equal_one_process(pools) -> None:
    ref = pools(1).run(predict_under, "dp", None, True)[0]
    results = pools(2).run(predict_under, "cp=2", None, True)
    assert results[0]["plan"].cp == 2 and results[1]["out"] is None
    torch.testing.assert_close(results[0]["out"], ref["out"], rtol=1e-5, atol=1e-6)
    assert all(abs(r["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]) for r in results)
