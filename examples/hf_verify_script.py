r"""A ``shardwise verify --script`` file for a Hugging Face model built from a small config (nothing is downloaded).

    shardwise verify --script examples/hf_verify_script.py --plan tp=2,pp=2,microbatches=2 --steps 10
    SHARDWISE_HF_FAMILY=gpt2 shardwise verify --script examples/hf_verify_script.py \
        --plan pp=2,microbatches=2,schedule=1f1b

The family is one of llama, qwen2, mistral, gemma, phi, gpt2, mixtral (4 layers, hidden 32, 4 heads,
2 key/value heads, vocabulary 64; dropout and the KV cache off). verify trains it under the plan and
as one process from the same seed on the same batches and prints the largest divergence.

The targets carry ragged loss masks, as instruction data does (each sample keeps one random span of
its targets, the rest -100: a prompt before, padding after): with verify's default
``--loss-reduction tokens`` every plan must match one process on them.
"""

import os

import torch

from shardwise.models import hf
from shardwise.verify.workloads import ragged_mask

FAMILY = os.environ.get("SHARDWISE_HF_FAMILY", "llama")
CONFIG = hf.tiny_config(FAMILY)
SEQ = 16


def build_model(seed: int) -> torch.nn.Module:
    return hf.build_causal_lm(CONFIG, seed=seed)


def make_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (size, SEQ + 1), generator=gen)
    return ids[:, :-1], ragged_mask(ids[:, 1:], gen)


loss_fn = hf.lm_loss
