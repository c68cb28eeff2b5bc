"""FP8 training (torchao's float8 Linear layers, emulated on this CPU) under every plan, against one
process with the same FP8 recipe.

**Tolerance: rtol 1e-5, float32's**, the same as every fp32 parity test here. That is the right
one, not a looser "FP8 tolerance", because with power-of-two scales (shardwise's default,
torchao's rowwise recipe) the FP8 value of every element in the normal range is its own mantissa
rounding, whatever the scale, so a data-parallel rank's half batch, a pipeline microbatch and a TP
shard all round exactly as one process does: what is left between a plan and one process is
float32's reduction order (measured: ~1e-7). A wrong scale, a layer converted on one side only or
an FP8 all-gather with a stale scale moves the loss by ~1e-3 (FP8's 2^-4 rounding), 100 times
the tolerance. Everything that is not an FP8 GEMM runs in fp32 here (the parity engine's
``Training.fp8``), so bf16 rounding does not hide anything.

Two cases are looser, each with its reason: torchao's tensorwise recipe with unrounded scales
(``power_of_2_scales=False``, where torchao's float8 TP styles are used): a scale depends on which
values share a tensor, so plans agree to FP8 rounding only (loss rtol 1e-3); and the Trainer's
default ``precision="fp8"``, whose unconverted ops run in bf16 autocast: bf16 rounds each value
to 2^-9 and a data-parallel rank rounds in another order, so loss rtol 1e-3 (measured 7e-5 over
these 6 steps). Resume from a checkpoint is bitwise in both.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import TensorDataset

from shardwise.parallel.fp8 import Fp8Options
from shardwise.verify.parity import GPTWorkload, Run, Training, parity_worker

pytest.importorskip("torchao")

RTOL = 1e-5
TRAINING = Training(steps=4, global_batch=8, fp8=Fp8Options(high_precision="fp32"))


def _check(per_rank, rtol: float = RTOL) -> None:
    for reports in per_rank:
        for report in reports:
            assert report.passed(rtol), report.format(rtol)


def layout_of(plan: str, fp8: Fp8Options) -> dict:
    """Which layers are FP8 under ``plan``, how FSDP gathers their weights, which TP styles hold them."""
    from shardwise.layout import Plan
    from shardwise.parallel.mesh import build_mesh
    from shardwise.parallel.parallelize import parallelize

    p = Plan.parse(plan)
    pm = parallelize(GPTWorkload().build(0), p, build_mesh(p, "cpu"), fp8=fp8)
    out: dict = {}
    for name, m in pm.module.named_modules():
        if isinstance(m, torch.nn.Linear):
            local = getattr(m.weight, "_local_tensor", m.weight)
            # parallelize_module's input hook closes over the style's _prepare_input_fn
            hooks = " ".join(getattr(getattr(c.cell_contents, "func", None), "__qualname__", "")
                             for h in m._forward_pre_hooks.values() for c in (getattr(h, "__closure__", None) or ()))
            out[name] = (
                type(m).__name__,
                type(local).__name__,
                "Float8ColwiseParallel" in hooks or "Float8RowwiseParallel" in hooks,
            )
    return out


def test_fp8_tensorwise_plans_match_one_process_on_2(dist2) -> None:
    """tensorwise under dp, zero=3 (FP8 all-gather), tp and pp. A few seconds of work; more when it
    starts the shared pool on a loaded machine."""
    tensorwise = [
        Run(f"{p},precision=fp8") for p in ("dp=2", "zero=3,shard=2", "tp=2", "pp=2,schedule=1f1b,microbatches=2")
    ]
    _check(dist2.run(parity_worker, GPTWorkload(), tensorwise, TRAINING))
    zero3 = dist2.run(layout_of, "zero=3,shard=2,precision=fp8", TRAINING.fp8)[0]
    assert zero3["blocks.0.attn.q_proj"][:2] == (
        "Float8Linear",
        "WeightWithDynamicFloat8CastTensor",
    )  # all-gathered in FP8
    assert zero3["lm_head"][0] == "Linear"


def test_fp8_rowwise_plans_match_one_process_on_2(dist2) -> None:
    rowwise = [Run(f"{p},precision=fp8,fp8_recipe=rowwise") for p in ("dp=2", "zero=3,shard=2", "tp=2")]
    _check(dist2.run(parity_worker, GPTWorkload(), rowwise, TRAINING))
    rowwise_zero3 = dist2.run(layout_of, "zero=3,shard=2,precision=fp8,fp8_recipe=rowwise", TRAINING.fp8)[0]
    assert rowwise_zero3["blocks.0.mlp.fc_in"][:2] == (
        "Float8Linear",
        "Tensor",
    )  # torchao gathers rowwise in high precision


def test_unrounded_tensorwise_uses_torchaos_float8_tp_styles(dist2) -> None:
    """torchao's exact tensorwise recipe: its Float8ColwiseParallel/RowwiseParallel under tp=2; a scale
    then depends on the values that share it, so parity is FP8 rounding's (module doc)."""
    fp8 = Fp8Options(high_precision="fp32", power_of_2_scales=False)
    layout = dist2.run(layout_of, "tp=2,precision=fp8", fp8)[0]
    assert layout["blocks.0.attn.q_proj"] == ("Float8Linear", "Tensor", True)
    assert layout["blocks.1.mlp.fc_out"] == ("Float8Linear", "Tensor", True)
    per_rank = dist2.run(
        parity_worker, GPTWorkload(), [Run("tp=2,precision=fp8"), Run("dp=2,precision=fp8")], replace(TRAINING, fp8=fp8)
    )
    for reports in per_rank:
        for report in reports:
            assert report.loss_diff < 1e-3 and report.grad_norm_diff < 2e-2, report.format(1e-3)


def test_fp8_dp_times_tp_matches_one_process_on_4(dist4) -> None:
    """dp x tp (replicate over TP DTensors) and FSDP x TP (2-D weights, FP8 all-gather of TP shards),
    tensorwise. Over 30 s on a loaded 2-core machine: 4 processes share 2 cores (and it may start
    the 4-process pool)."""
    tensorwise = [Run("dp=2,tp=2,precision=fp8"), Run("zero=3,shard=2,tp=2,precision=fp8")]
    _check(dist4.run(parity_worker, GPTWorkload(), tensorwise, TRAINING))


def test_fp8_rowwise_dp_times_tp_with_accumulation_on_4(dist4) -> None:
    _check(
        dist4.run(
            parity_worker, GPTWorkload(), [Run("dp=2,tp=2,precision=fp8,fp8_recipe=rowwise", accumulation=2)], TRAINING
        )
    )


# -- the Trainer: bf16 for what is not converted, checkpoints -----------------------------------
TOTAL, STOP = 6, 3


def _data() -> TensorDataset:
    shape = GPTWorkload().shape
    ids = torch.randint(0, shape.vocab_size, (96, shape.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def fit_fp8(plan: str, directory: str | None, max_steps: int, resume: str | None, model_seed: int) -> dict:
    from shardwise.checkpoint import CheckpointManager
    from shardwise.train import LoggingOptions, TrainOptions, Trainer
    from tests.helpers import Record

    rec = Record()
    manager = CheckpointManager(directory, every_n_steps=STOP, async_save=False) if directory else None
    trainer = Trainer(GPTWorkload().build(model_seed), loss_fn=_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3),
                      plan=plan, global_batch_size=16, train=TrainOptions(max_steps=max_steps, seed=7),
                      logging=LoggingOptions(log_every=1, progress_bar=False), checkpoint=manager, callbacks=[rec])
    trainer.fit(_data(), resume=resume)
    msd, osd = get_state_dict(trainer.model.module, [trainer.optimizer], options=StateDictOptions(full_state_dict=True))
    state = {f"model.{k}": v.clone() for k, v in msd.items()}
    state.update(
        {
            f"optim.{fqn}.{key}": v.clone()
            for fqn, st in osd["state"].items()
            for key, v in st.items()
            if isinstance(v, torch.Tensor)
        }
    )
    kinds = {type(m).__name__ for m in trainer.model.module.modules()}
    return {"losses": rec.losses, "state": state, "float8": "Float8Linear" in kinds, "step": trainer.step}


def test_trainer_fp8_in_bf16_matches_one_process_and_resumes_bitwise(pools, tmp_path_factory) -> None:
    plan = "zero=3,dp=2,precision=fp8"  # tensorwise, FP8 all-gather, bf16 autocast + bf16 param_dtype elsewhere
    one = pools(1).run(fit_fp8, "precision=fp8", None, TOTAL, None, 0)[0]
    straight_dir, cut_dir = (str(tmp_path_factory.mktemp(n)) for n in ("fp8_straight", "fp8_cut"))
    straight = pools(2).run(fit_fp8, plan, straight_dir, TOTAL, None, 0)
    assert one["float8"] and straight[0]["float8"]
    torch.testing.assert_close(torch.tensor(straight[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-3, atol=0)
    pools(2).run(fit_fp8, plan, cut_dir, STOP, None, 0)
    resumed = pools(2).run(
        fit_fp8, plan, cut_dir, TOTAL, "auto", 99
    )  # another init: everything comes from the checkpoint
    for s, r in zip(straight, resumed):
        assert r["step"] == TOTAL and r["losses"] == s["losses"][STOP:]
        assert s["state"].keys() == r["state"].keys()
        for key in s["state"]:
            assert torch.equal(s["state"][key], r["state"][key]), key
