r"""A ``shardwise verify --script`` file for a Hugging Face model in a user's own two-line wrapper.

    shardwise verify --script examples/hf_wrapped_script.py --plan cp=2 --steps 4
    SHARDWISE_HF_FAMILY=phi3 SHARDWISE_HF_ATTENTION=eager \
        shardwise verify --script examples/hf_wrapped_script.py --plan tp=2

The model is what a new user writes: an ``nn.Module`` whose ``forward(ids)`` returns the logits of
the Hugging Face model it holds, with the attention implementation it picked
(``SHARDWISE_HF_ATTENTION``: ``sdpa``, the default, or ``eager``). shardwise never built it, so
whatever a plan needs (the context-parallel positions, the TP styles, the pipeline cut) it finds in
the module tree. The family is one of ``shardwise.models.hf.FAMILIES`` (tiny configs: 4 layers,
hidden 32, nothing downloaded).
"""

import os

import torch
from torch import nn

from shardwise.models import hf
from shardwise.verify.workloads import ragged_mask

FAMILY = os.environ.get("SHARDWISE_HF_FAMILY", "llama")
ATTENTION = os.environ.get("SHARDWISE_HF_ATTENTION", "sdpa")
CONFIG = hf.tiny_config(FAMILY)
CONFIG._attn_implementation = ATTENTION
SEQ = 16


class Wrapped(nn.Module):
    """The user's wrapper: token ids in, logits out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


def build_model(seed: int) -> nn.Module:
    return Wrapped(hf.build_causal_lm(CONFIG, seed=seed))


def make_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, CONFIG.vocab_size, (size, SEQ + 1), generator=gen)
    return ids[:, :-1], ragged_mask(ids[:, 1:], gen)


loss_fn = hf.lm_loss
