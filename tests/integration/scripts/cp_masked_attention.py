"""A verify script whose attention passes a mask: context parallel refuses it inside the workers (each rank,
at its first forward)."""

import torch
import torch.nn.functional as F
from torch import nn


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.qkv = nn.Linear(8, 24)
        self.head = nn.Linear(8, 16)

    def forward(self, ids, position_ids=None):
        x = self.emb(ids)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
        return self.head(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(1))


def build_model(seed):
    torch.manual_seed(seed)
    return Masked()


def make_batch(step, size):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 16, (size, 9), generator=g)
    return ids[:, :-1], ids[:, 1:]


def loss_fn(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())
