"""The merge in torch: ``X'[i] = post[i] · y + sum_j comb[j, i] · X[j]`` and its backward ``d X[j] = sum_i comb[j, i]
· g[i]``, ``d y = sum_i post[i] · g[i]``, ``d post[i] = <g[i], y>``, ``d comb[j, i] = <X[j], g[i]>``, in float32 on
token chunks (``map_token_chunks``). With ``identity`` (``comb`` empty): ``X'[i] = post[i] · y + X[i]``, ``d X = g``
and no ``d comb``. Reference: ``hf_mhc.mhc_reference.mhc_post_res``."""

from __future__ import annotations

import torch

from .common import batched_dots, map_token_chunks, without_autocast


def _merge(x, y, post, comb):
    mixed = torch.matmul(comb.float().transpose(-1, -2), x.float())
    return (mixed.addcmul_(post.float().unsqueeze(-1), y.float().unsqueeze(-2)),)


def _merge_backward(x, y, post, comb, grad_out):
    """``(d X, d y, d post, d comb)`` of one chunk of tokens, in float32."""
    grad32 = grad_out.float()
    return (torch.matmul(comb.float(), grad32), torch.matmul(post.float().unsqueeze(-2), grad32).squeeze(-2),
            batched_dots(grad32, y.float()), torch.matmul(x.float(), grad32.transpose(-1, -2)))


def _carry(x, y, post):
    """The identity map's merge: ``X'[i] = post[i] · y + X[i]``."""
    return (x.float().addcmul(post.float().unsqueeze(-1), y.float().unsqueeze(-2)),)


def _carry_backward(y, post, grad_out):
    """``(d X, d y, d post)`` of the identity map's merge (``d X`` a copy of ``g``: op outputs never alias inputs)."""
    grad32 = grad_out.to(torch.float32, copy=True)
    return (grad32, torch.matmul(post.float().unsqueeze(-2), grad32).squeeze(-2), batched_dots(grad32, y.float()))


@without_autocast
def post_res_forward(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     identity: bool) -> torch.Tensor:
    """The new streams ``[..., n, C]`` (streams' dtype)."""
    n, hidden = streams.shape[-2:]
    if identity:
        return map_token_chunks(_carry, (streams, y, post), (streams.dtype,), 4 * (n + 1) * hidden)[0]
    return map_token_chunks(_merge, (streams, y, post, comb), (streams.dtype,), 4 * (2 * n + 1) * hidden)[0]


@without_autocast
def post_res_backward(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      grad_out: torch.Tensor, identity: bool) -> tuple[torch.Tensor, ...]:
    """``(d streams, d y, d post, d comb)``; ``d comb`` empty for ``identity``."""
    n, hidden = streams.shape[-2:]
    if identity:
        grad_streams, grad_y, grad_post = map_token_chunks(
            _carry_backward, (y, post, grad_out), (streams.dtype, y.dtype, torch.float32), 4 * (n + 1) * hidden)
        return grad_streams, grad_y, grad_post, comb.new_empty(0)
    return tuple(map_token_chunks(_merge_backward, (streams, y, post, comb, grad_out),
                                  (streams.dtype, y.dtype, torch.float32, torch.float32), 4 * (3 * n + 1) * hidden))
