"""``Trainer(..., train=TrainOptions(loss_reduction="tokens"))``: the update of every plan equals one process running
the user's own mean loss, ``F.cross_entropy(..., ignore_index=-100)``, over the whole global batch.

The targets carry ragged masks (each sample keeps one random span of its targets, from none to all
of them, the rest ``-100``), so micro-batches, data-parallel shards, context-parallel chunks and
pipeline microbatches hold different numbers of valid targets, some none. The reference is a
hand-written loop in this process. Compared after 3 SGD-with-momentum steps at rtol 1e-5: the
logged loss of every step (the global token mean) and every final weight. ``"samples"`` on the
same data is shown to diverge, so the data can expose the accumulation bug. A weight's divergence
is ``shardwise verify``'s: its largest difference relative to the tensor's scale.

Runs of one world size share one pool call (one set of worker processes):
1 process with accumulation 4 (and ``samples``); on 2: ``dp=2`` with accumulation 2, ``zero=3``,
``pp=2`` GPipe, 1F1B and interleaved 1F1B, ``cp=2``, Hugging Face Mixtral under ``dp=2,ep=2``, and a ``prepare()``
loop with :meth:`Prepared.loss_weights`; on 4: ``dp=2,tp=2`` with loss-parallel, HSDP
(``zero=3,dp=2,shard=2``), ``dp=2,pp=2`` with accumulation 2 and a Hugging Face Llama under
``tp=2,pp=2``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from dataclasses import replace

from shardwise.models.gpt import GPT
from shardwise.parallel.tp import TPOptions
from shardwise.train import Callback, DataOptions, LoggingOptions, ParallelOptions, TrainOptions, Trainer
from shardwise.verify.workloads import SMALL_GPT, ragged_mask

GLOBAL, STEPS, SEQ = 8, 3, 16


def make_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (GLOBAL * STEPS, SEQ + 1), generator=gen)
    return TensorDataset(ids[:, :-1], ragged_mask(ids[:, 1:], gen))


def build(kind: str) -> torch.nn.Module:
    if kind == "gpt":
        return GPT(SMALL_GPT, seed=0)
    if kind == "gpt4":  # four blocks: two virtual stages on each of two pipeline ranks
        return GPT(replace(SMALL_GPT, layers=4), seed=0)
    from shardwise.models import hf

    return hf.build_causal_lm(hf.tiny_config(kind), seed=0)


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:  # what every fine-tuning recipe writes
    logits = output if isinstance(output, torch.Tensor) else output.logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


def sgd(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def reference(kind: str) -> dict:
    """One process, the whole global batch per step, the user's own mean loss."""
    model, data = build(kind), make_data()
    opt = sgd(model.parameters())
    losses = []
    for step in range(STEPS):
        x, y = data.tensors[0][step * GLOBAL:(step + 1) * GLOBAL], data.tensors[1][step * GLOBAL:(step + 1) * GLOBAL]
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


class Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step_end(self, trainer, metrics) -> None:
        self.losses.append(metrics["loss"])


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from shardwise.parallel.pipeline import stage_modules

    out = {}
    for stage in stage_modules(module):  # a rank's virtual stages hold the whole model's names
        for name, p in stage.named_parameters():
            out[name.removeprefix("module.")] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    return out


def fit(kind: str, plan: str, accum: int = 1, reduction: str = "tokens", loss_parallel: bool = False) -> dict:
    rec = Record()
    trainer = Trainer(build(kind), loss_fn=loss_fn, optimizer=sgd, plan=plan, global_batch_size=GLOBAL,
                      train=TrainOptions(grad_accum_steps=accum, max_steps=STEPS, loss_reduction=reduction),
                      data=DataOptions(shuffle=False),
                      parallel=ParallelOptions(tp=TPOptions(loss_parallel=loss_parallel)),
                      logging=LoggingOptions(log_every=1, progress_bar=False), callbacks=[rec])
    trainer.fit(make_data())
    return {
        "losses": rec.losses,
        "weights": _weights(trainer.model.module),
        "reduction": trainer.run_info()["loss_reduction"],
    }


def prepared_loop(accum: int = 2) -> dict:
    """A user's own loop over ``prepare()``: accumulation with the token weights."""
    import shardwise

    model, opt, loader = prepared = shardwise.prepare(
        build("gpt"), sgd, make_data(), batch_size=GLOBAL // (2 * accum), shuffle=False, loss_reduction="tokens"
    )
    batches = list(loader)
    for step in range(STEPS):
        micro = batches[step * accum:(step + 1) * accum]
        weights = prepared.loss_weights([y for _, y in micro])
        for i, (x, y) in enumerate(micro):
            with prepared.parallel.gradient_sync(i == accum - 1):
                (loss_fn(model(x), y) * weights[i]).backward()
        opt.step()
        opt.zero_grad()
    return {"weights": _weights(model)}


def runs(*configs: tuple) -> list[dict]:
    """Each ``(kind, plan, accum, reduction, loss_parallel)`` in one worker call (``"prepare"``: the prepare() loop)."""
    return [prepared_loop() if c[0] == "prepare" else fit(*c) for c in configs]


def merged_weights(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's weights (a pipeline stage holds only its own)."""
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r["weights"])
    return out


def divergence(got: torch.Tensor, want: torch.Tensor) -> float:
    """``shardwise verify``'s measure: the largest difference relative to the tensor's scale (at least 0.01)."""
    return float((got - want).abs().max() / want.abs().max().clamp_min(0.01))


def check(ref: dict, per_rank: list[dict], what: str, *, losses: bool = True) -> None:
    got = merged_weights(per_rank)
    assert got.keys() == ref["weights"].keys(), what
    for name, want in ref["weights"].items():
        assert divergence(got[name], want) <= 1e-5, f"{what}: {name} diverges by {divergence(got[name], want):.2e}"
    if losses:
        for r in per_rank:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0.0,
                                       msg=lambda m: f"{what}: logged loss: {m}")


def test_one_process_with_accumulation_4(pools) -> None:
    ref = reference("gpt")
    tokens, samples = pools(1).run(runs, ("gpt", "dp", 4, "tokens"), ("gpt", "dp", 4, "samples"))[0]
    assert tokens["reduction"] == "tokens"
    check(ref, [tokens], "1 process, accumulation 4")
    # the same data exposes the bug token reduction fixes: micro-batch means averaged
    worst = max(divergence(samples["weights"][n], w) for n, w in ref["weights"].items())
    assert worst > 1e-2, worst


def test_plans_on_two_processes(pools) -> None:
    # ~35 s under load: eight Trainer fits in one pool call (apart, each would pay for its own call)
    refs = {kind: reference(kind) for kind in ("gpt", "gpt4", "mixtral")}
    configs = [
        ("gpt", "dp=2", 2),
        ("gpt", "zero=3,shard=2", 1),
        ("gpt", "pp=2,microbatches=2", 1),
        ("gpt", "pp=2,microbatches=2,schedule=1f1b", 1),
        ("gpt4", "pp=2,virtual_stages=2,microbatches=2,schedule=interleaved_1f1b", 1),
        ("gpt", "cp=2", 1),
        ("mixtral", "dp=2,ep=2", 1),
        ("prepare",),
    ]
    per_rank = pools(2).run(runs, *configs)
    for i, config in enumerate(configs):
        results = [rank[i] for rank in per_rank]
        check(
            refs["gpt" if config[0] == "prepare" else config[0]],
            results,
            " ".join(map(str, config)),
            losses=config[0] != "prepare",
        )


def test_plans_on_four_processes(pools) -> None:
    # ~45 s under load on 2 cores: four 4-process fits (two of them pipelines) in one pool call
    gpt, llama = reference("gpt"), reference("llama")
    configs = [
        ("gpt", "dp=2,tp=2", 1, "tokens", True),
        ("gpt", "zero=3,dp=2,shard=2", 1),
        ("gpt", "dp=2,pp=2,microbatches=2", 2),
        ("llama", "tp=2,pp=2,microbatches=2", 1),
    ]
    per_rank = pools(4).run(runs, *configs)
    for i, config in enumerate(configs):
        check(llama if config[0] == "llama" else gpt, [rank[i] for rank in per_rank], " ".join(map(str, config)))


def regression_under_tokens() -> str:
    trainer = Trainer(torch.nn.Linear(4, 2), loss_fn=F.mse_loss, global_batch_size=4,
                      train=TrainOptions(max_steps=1, loss_reduction="tokens"),
                      logging=LoggingOptions(progress_bar=False))
    try:
        trainer.fit(TensorDataset(torch.randn(8, 4), torch.randn(8, 2)))
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return str(exc)
    return "no error"


def test_float_targets_are_refused_under_tokens(pools) -> None:
    message = pools(1).run(regression_under_tokens)[0]
    assert "loss_reduction='tokens' needs targets that are integer class ids, got torch.float32" in message
    assert "loss_reduction='samples'" in message


@pytest.mark.parametrize("value", ["token", None])
def test_unknown_reduction_is_one_line(value) -> None:
    from shardwise.errors import ConfigError

    with pytest.raises(ConfigError, match="loss_reduction=.* is unknown"):
        Trainer(torch.nn.Linear(2, 2), loss_fn=F.mse_loss, global_batch_size=2,
                train=TrainOptions(loss_reduction=value))
