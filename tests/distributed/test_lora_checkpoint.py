"""Adapter checkpoints of a LoRA run (``Trainer(Pretrained(dir, lora=LoRA(...)))``, token-mean loss over
ragged masks, AdamW, clipping):

- saved on 4 ranks under ``zero=3,tp=2``, loaded on 2 (``zero=3``) and on 1: every adapter element
  and every Adam moment equal after gathering (the Accelerate #4206 bug: a sharded save that kept
  one rank's slice), the frozen base bitwise equal to the directory's weights in every run;
- the checkpoint holds the adapters and their optimizer state only, no frozen tensor;
- resume is exact (4 steps straight = 2 steps, resume, 2 more, bitwise), and a resume against
  another base directory is refused with one line naming both;
- ``export --format peft`` gives, through ``PeftModel.from_pretrained``, the logits of the trained
  model (loaded on one process), and ``--format hf --merge`` gives them through plain transformers.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from shardwise.errors import ConfigError  # noqa: E402

SEQ, VOCAB = 16, 64
LORA_R = 4


def _lora():
    from shardwise.models.lora import LoRA

    return LoRA(r=LORA_R, alpha=8, init_b_zero=False)


def _data(n: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=gen)
    out = []
    for i in range(n):
        target = ids[i, 1:].clone()
        target[: int(torch.randint(0, SEQ - 2, (), generator=gen))] = -100  # a ragged prompt that does not count
        out.append((ids[i, :-1], target))
    return out


def _trainer(model_dir: str, plan: str, ckpt: str, *, max_steps: int, every: int | None = None):
    from shardwise import DataOptions, LoggingOptions, Pretrained, Trainer, TrainOptions
    from shardwise.checkpoint import CheckpointManager
    from shardwise.models.hf import lm_loss

    return Trainer(Pretrained(model_dir, lora=_lora(), seed=1), loss_fn=lm_loss, global_batch_size=8, plan=plan,
                   optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
                   train=TrainOptions(max_steps=max_steps, clip_grad_norm=0.5, loss_reduction="tokens"),
                   data=DataOptions(shuffle=True), logging=LoggingOptions(progress_bar=False, log_every=1),
                   checkpoint=CheckpointManager(ckpt, every_n_steps=every, keep_last_n=None))


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _state(trainer) -> dict[str, torch.Tensor]:
    """Every adapter (full) and its Adam moments (full), by name."""
    out = {}
    module = trainer.model.module
    for name, p in module.named_parameters():
        if p.requires_grad:
            out[name] = _full(p)
            for key, value in trainer.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    out[f"{name}:{key}"] = _full(value)
    return out


def _base_unchanged(trainer, model_dir: str) -> bool:
    from shardwise.checkpoint.safetensors_files import SafetensorsFiles
    from shardwise.models.lora import base_key

    with SafetensorsFiles(model_dir) as files:
        return all(torch.equal(_full(p), files.read(base_key(n)))
                   for n, p in trainer.model.module.named_parameters() if not p.requires_grad)


def train_and_save(model_dir: str, plan: str, ckpt: str, steps: int) -> dict:
    trainer = _trainer(model_dir, plan, ckpt, max_steps=steps)
    trainer.fit(_data())
    return {"state": _state(trainer), "base": _base_unchanged(trainer, model_dir)}


def load_saved(model_dir: str, plan: str, ckpt: str, steps: int) -> dict:
    trainer = _trainer(model_dir, plan, ckpt, max_steps=steps)
    loaded = trainer.checkpoint.manager.load(trainer.stateful_components())
    x = _data(2)[0][0][None]
    with torch.no_grad():
        logits = trainer.model.module(x).logits
    return {"state": _state(trainer), "base": _base_unchanged(trainer, model_dir), "resharded": loaded.resharded,
            "logits": _full(logits)}


def resume_is_exact(model_dir: str, ckpt_a: str, ckpt_b: str) -> bool:
    straight = _trainer(model_dir, "zero=3,shard=2", ckpt_a, max_steps=4)
    straight.fit(_data())
    first = _trainer(model_dir, "zero=3,shard=2", ckpt_b, max_steps=2)
    first.fit(_data())
    resumed = _trainer(model_dir, "zero=3,shard=2", ckpt_b, max_steps=4)
    resumed.fit(_data(), resume="auto")
    a, b = _state(straight), _state(resumed)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and resumed.step == 4


def refused_on_another_base(other_dir: str, ckpt: str) -> str:
    trainer = _trainer(other_dir, "dp=1", ckpt, max_steps=8)
    try:
        trainer.fit(_data(), resume="auto")
    except ConfigError as exc:
        return str(exc)
    return "not refused"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from shardwise.models.hf import save_tiny

    texts = [open(os.__file__).read()[:4000]]
    base = tmp_path_factory.mktemp("base")
    other = tmp_path_factory.mktemp("other")
    save_tiny(str(base), family="llama", texts=texts, vocab=VOCAB, seed=0, seq=SEQ)
    save_tiny(str(other), family="llama", texts=texts, vocab=VOCAB, seed=7, seq=SEQ)
    return str(base), str(other)


def test_reshard_4_2_1_exports_and_refusal(dist4, dist2, pools, model_dirs, tmp_path) -> None:
    # Over 30 s: one training run on 4 ranks, loads on 2 and 1, two exports and a refused resume share
    # this one test so the 4 -> 2 -> 1 chain is built once (it may also start the 4- and 1-process pools).
    from safetensors import safe_open

    base, other = model_dirs
    ckpt = str(tmp_path / "ckpt")
    saved = dist4.run(train_and_save, base, "zero=3,shard=2,tp=2", ckpt, 3)[0]
    assert saved["base"], "the frozen base changed in training"
    on_two = dist2.run(load_saved, base, "zero=3,shard=2", ckpt, 3)[0]
    on_one = pools(1).run(load_saved, base, "dp=1", ckpt, 3)[0]
    for loaded in (on_two, on_one):
        assert loaded["resharded"] and loaded["base"]
        assert loaded["state"].keys() == saved["state"].keys() and any(":exp_avg" in k for k in saved["state"])
        for key, value in saved["state"].items():
            assert torch.equal(loaded["state"][key], value), key

    from shardwise.checkpoint.safe_io import SafeFileSystemReader
    from shardwise.checkpoint.commit import latest_complete

    step_dir = latest_complete(ckpt).path
    names = [
        k
        for k in SafeFileSystemReader(step_dir).read_metadata().state_dict_metadata
        if k.startswith(("model.", "optim."))
    ]
    assert names and all(".lora_" in k for k in names), [k for k in names if ".lora_" not in k][:3]

    # the PEFT export gives the trained logits through peft, the merged one through transformers alone
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardwise.checkpoint.peft_export import export_merged, export_peft

    x = _data(2)[0][0][None]
    export_peft(ckpt, str(tmp_path / "adapter"))
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), framework="pt") as f:
        assert all(".lora_" in k and ".default." not in k for k in f.keys())
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "adapter"))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, on_one["logits"], rtol=1e-5, atol=1e-5)
        export_merged(ckpt, str(tmp_path / "merged"))
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
        assert not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(x).logits, on_one["logits"], rtol=1e-5, atol=1e-5)

    message = pools(1).run(refused_on_another_base, other, ckpt)[0]
    assert "trained on the base" in message and other in message and "\n" not in message, message


def test_resume_is_exact(dist2, model_dirs, tmp_path) -> None:
    assert dist2.run(resume_is_exact, model_dirs[0], str(tmp_path / "a"), str(tmp_path / "b"))[0]
