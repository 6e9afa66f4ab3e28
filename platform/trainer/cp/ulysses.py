"""Ulysses: all-to-all between "my tokens, all heads" and "all tokens, my heads".

One all-to-all turns each rank's slice of the tokens (all heads) into all the group's tokens
for its share of the heads; each rank then attends over whole documents for H/u heads, and a
second all-to-all turns the output back. Cheap on fast links, but the degree is bounded by the
head count. Both directions are autograd functions whose backward is the other direction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _all_to_all(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class SeqToHeads(torch.autograd.Function):
    """[T, H, D] on each of u members -> [u*T, H/u, D]: every member's tokens (member-major)
    for this member's slice of heads."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _heads_to_seq(grad, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _seq_to_heads(grad, ctx.group), None


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    u = dist.get_world_size(group)
    t, h, d = x.shape
    chunks = x.reshape(t, u, h // u, d).transpose(0, 1).contiguous()  # chunk j goes to member j
    return _all_to_all(chunks, group).reshape(u * t, h // u, d)


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    u = dist.get_world_size(group)
    n, hu, d = x.shape
    back = _all_to_all(x.reshape(u, n // u, hu, d).contiguous(), group)  # [j] = my tokens, j's heads
    return back.transpose(0, 1).reshape(n // u, u * hu, d)
