"""A ``shardwise verify --script`` file for LoRA: a small Hugging Face model with peft adapters on its
attention and MLP projections (nothing is downloaded).

    shardwise verify --script examples/lora_verify_script.py --plan tp=2 --steps 10
    SHARDWISE_HF_FAMILY=mixtral shardwise verify --script examples/lora_verify_script.py --plan dp=2,ep=2

The base is frozen; ``B`` starts random (not zero), so the adapters change the output from the first
step and a misplaced shard shows at once. verify trains the adapters under the plan and as one
process from the same seed on the same batches, and prints the largest divergence; the frozen
weights must come out bitwise unchanged.
"""

import os

import torch

from shardwise.models import hf
from shardwise.models.lora import LoRA, add_adapters

FAMILY = os.environ.get("SHARDWISE_HF_FAMILY", "llama")
CONFIG = hf.tiny_config(FAMILY)
LORA = LoRA(r=4, alpha=8, init_b_zero=False)  # the family's default targets
SEQ = 16


def build_model(seed: int) -> torch.nn.Module:
    return add_adapters(hf.build_causal_lm(CONFIG, seed=seed), LORA, seed=seed + 1)


def make_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (size, SEQ + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


loss_fn = hf.lm_loss
