"""Per-block ``torch.compile`` (``plan compile``) against eager, and its recompiles.

Parity: compiled blocks under zero=3 and tp=2 (and with FP8 under zero=3) against one eager process,
fp32, rtol 1e-5 (inductor reorders float32 sums; nothing else may differ). No recompiles: a plain
GPT block compiled once must not compile again after the first step (a recompile means a guard
failed every step: the compiled code would be thrown away and rebuilt).

Slow on 2 cores on purpose (each distinct graph is compiled by inductor, ~20 s cold per process:
the plain block, the block on TP DTensors, the FP8 block); the checks share one pool and one
parity call per reference, and dynamo's cache reuses a graph across runs of the same shape.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.verify.parity import GPTWorkload, Run, Training, parity_worker

RTOL = 1e-5
TRAINING = Training(steps=3, global_batch=8)


def _check(per_rank) -> None:
    for reports in per_rank:
        for report in reports:
            assert report.passed(RTOL), report.format(RTOL)


def compiled_fit(plan: str, steps: int) -> dict:
    """The Trainer on a compiled GPT: what the compile log counted after the first step."""
    from shardwise.observe.compile_log import CompileLog
    from shardwise.parallel.compile import compile_stats
    from tests.distributed.test_fp8 import _data, _loss

    from shardwise.train import LoggingOptions, TrainOptions, Trainer

    log = CompileLog()

    trainer = Trainer(GPTWorkload().build(0), loss_fn=_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), plan=plan,
                      global_batch_size=16, train=TrainOptions(max_steps=steps, seed=7),
                      logging=LoggingOptions(log_every=1, progress_bar=False), callbacks=[log])
    trainer.fit(_data())
    compiled = [
        type(m).__name__ for m in trainer.model.module.modules() if getattr(m, "_compiled_call_impl", None) is not None
    ]
    return {
        "compiled": compiled,
        "recompiles": log.recompiles,
        "first": log.first,
        "last": compile_stats(),
        "active": log.active,
    }


@pytest.mark.slow  # inductor compiles the plain block's forward and backward (~20 s cold per process)
def test_compiled_zero3_matches_eager_and_a_gpt_block_does_not_recompile(dist2) -> None:
    _check(dist2.run(parity_worker, GPTWorkload(), [Run("zero=3,shard=2,compile")], TRAINING))
    # the same block graph again, in the Trainer: cached by dynamo from the run above
    for res in dist2.run(compiled_fit, "dp=2,compile", 4):
        assert res["active"] and res["compiled"] == ["Block", "Block"]  # each block, in torchtitan's place
        assert res["first"].graph_breaks == 0, res["first"].summary()
        assert res["recompiles"] == 0 and res["last"].graphs == res["first"].graphs, res["last"].summary()


@pytest.mark.slow  # the block on TP DTensors is a graph of its own (~20 s cold per process)
def test_compiled_tp_matches_eager(dist2) -> None:
    _check(dist2.run(parity_worker, GPTWorkload(), [Run("tp=2,compile")], TRAINING))


@pytest.mark.slow  # the FP8 block (emulated casts and GEMMs) is a graph of its own (~20 s cold per process)
def test_compiled_fp8_blocks_match_eager_fp8(dist2) -> None:
    pytest.importorskip("torchao")
    from dataclasses import replace

    from shardwise.parallel.fp8 import Fp8Options

    training = replace(TRAINING, fp8=Fp8Options(high_precision="fp32"))
    _check(dist2.run(parity_worker, GPTWorkload(), [Run("zero=3,shard=2,compile,precision=fp8")], training))


def test_compile_log_is_silent_without_compile(dist2) -> None:
    res = dist2.run(compiled_fit, "dp=2", 2)[0]
    assert not res["active"] and res["compiled"] == [] and res["recompiles"] == 0
