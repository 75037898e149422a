"""The head's cross-entropy and its gradient, a tile of tokens at a time (docs/design/head.md).

A device's ``[N, V]`` fp32 logits and their gradient would take ``(4 + 4) · N · V`` bytes when
differentiated as one einsum (16 GiB for 64K tokens at a 32K vocabulary). :func:`head_loss`
computes a tile of tokens' logits (``jvarlen.head_tiles``), their log-partition, their losses and,
asked for, the gradient (softmax minus one-hot, in the compute dtype) and its two products in one
pass, so at most one tile's logits exist at once and none is kept for a later backward. The
gradient is thus computed in the forward: :func:`head_loss_sum` is the custom VJP that hands it to
``jax.grad`` (scaled by the cotangent), and the pipeline executor, which writes its head's
gradients itself, calls :func:`head_loss` with its loss scale.

The same pass serves the head split by vocabulary over sp (``rest.VocabShard``): ``combine`` turns
each token's statistics over this device's columns into the whole vocabulary's with collectives.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jvarlen import head_tiles

Combine = Callable[[jax.Array, jax.Array, jax.Array], tuple]


def local_combine(top, sum_exp, at_target):
    """(log-partition, target logit) per token when ``w`` holds every column."""
    return top + jnp.log(sum_exp), at_target


def head_loss(h, w, rows, hit, mask, *, grad_scale=None, combine: Optional[Combine] = None, dh_dtype=jnp.float32):
    """Token losses of normed outputs ``h [N, d]`` against head columns ``w [d, C]`` (both in the
    compute dtype) and, where ``grad_scale`` is given, the gradients of ``grad_scale · Σ losses``.

    ``rows [N]``: each token's target column in ``w``, used where ``hit`` (every token when ``w`` is
    the whole head); ``mask [N]``: 1 where a token has a target (its loss weight).
    ``combine(top, sum_exp, at_target)`` maps per-token statistics over ``w``'s columns (max logit,
    Σ exp(logit - max), the target's logit or 0) to (log-partition, target logit) over the whole
    vocabulary; default :func:`local_combine`.

    Returns ``losses [N]`` (fp32), or ``(losses, dw [d, C] fp32, dh [N, d] in dh_dtype)``: each tile's
    ``dh`` is rounded to ``dh_dtype`` as it is written (fp32 where it is summed over devices next).
    """
    combine = combine or local_combine
    n, columns = h.shape[0], w.shape[1]
    tiles, size = head_tiles.logits_tiles(n, columns, h.shape[1])
    grads = grad_scale is not None
    mask = mask.astype(jnp.float32)
    weight = mask * grad_scale if grads else mask

    def tile(h_t, rows_t, hit_t, mask_t, weight_t):
        z = jnp.einsum("td,dc->tc", h_t, w, preferred_element_type=jnp.float32)
        top = jnp.max(z, axis=-1)
        sum_exp = jnp.sum(jnp.exp(z - top[:, None]), axis=-1)
        row = jnp.clip(rows_t, 0, columns - 1)
        at_target = jnp.where(hit_t, jnp.take_along_axis(z, row[:, None], axis=-1)[:, 0], 0.0)
        log_z, target = combine(top, sum_exp, at_target)
        losses = (log_z - target) * mask_t
        if not grads:
            return losses, None, None
        onehot = jnp.arange(columns)[None, :] == jnp.where(hit_t, row, -1)[:, None]
        dz = ((jnp.exp(z - log_z[:, None]) - onehot) * weight_t[:, None]).astype(w.dtype)
        dw = jnp.einsum("td,tc->dc", h_t, dz, preferred_element_type=jnp.float32)
        dh = jnp.einsum("tc,dc->td", dz, w, preferred_element_type=jnp.float32).astype(dh_dtype)
        return losses, dw, dh

    operands = (h, rows, hit, mask, weight)
    if tiles == 1:
        losses, dw, dh = tile(*operands)
        return (losses, dw, dh) if grads else losses

    pad = tiles * size - n
    tiled = [jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(tiles, size, *x.shape[1:]) for x in operands]

    def step(dw_sum, xs):
        losses_t, dw_t, dh_t = tile(*xs)
        return (dw_sum if dw_t is None else dw_sum + dw_t), (losses_t, dh_t)

    dw0 = jnp.zeros((h.shape[1], columns), jnp.float32) if grads else None
    dw, (losses, dh) = jax.lax.scan(step, dw0, tiled)
    losses = losses.reshape(-1)[:n]
    return (losses, dw, dh.reshape(-1, h.shape[1])[:n]) if grads else losses


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def head_loss_sum(h, w, targets, mask, spmd=None):
    """``Σ mask · (log Σ exp(h·w) - (h·w)[target])`` over the tokens of ``h [..., d]`` against the
    whole head ``w [d, V]``, differentiable in ``h`` and ``w``: the gradient is computed with the
    loss (:func:`head_loss`) and kept for the backward instead of the logits.

    ``spmd(fn, grads)``, where given, maps ``fn`` over a mesh's token shards and sums its loss (and
    with ``grads`` its ``w`` gradient, in fp32) over them (``jvarlen.parallel.sharding.TokenShards``:
    the fused step's rows and tokens), so that each device tiles its own tokens."""
    return _run(spmd, False, h, w, targets, mask)


def _run(spmd, grads: bool, *args):
    fn = functools.partial(_local_sum, grads)
    return fn(*args) if spmd is None else spmd(fn, grads)(*args)


def whole_head_loss(h, w, targets, mask, *, grad_scale=None):
    """:func:`head_loss` of ``h [N, d]`` against the whole head ``w [d, V]`` (every target is one of
    its columns), ``dh`` in ``h``'s dtype."""
    targets = targets.astype(jnp.int32)
    return head_loss(h, w, targets, jnp.ones_like(targets, bool), mask, grad_scale=grad_scale, dh_dtype=h.dtype)


def _local_sum(grads: bool, h, w, targets, mask):
    """(loss sum, and with ``grads`` the gradients of ``w`` (fp32) and of ``h``) of one device's tokens."""
    h2 = h.reshape(-1, h.shape[-1])
    scale = jnp.float32(1.0) if grads else None
    out = whole_head_loss(h2, w, targets.reshape(-1), mask.reshape(-1), grad_scale=scale)
    if not grads:
        return jnp.sum(out)
    losses, dw, dh = out
    return jnp.sum(losses), dw, dh.reshape(h.shape)


def _head_loss_sum_fwd(h, w, targets, mask, spmd):
    loss, dw, dh = _run(spmd, True, h, w, targets, mask)
    return loss, (dw, dh, jnp.zeros((), w.dtype))


def _head_loss_sum_bwd(spmd, residuals, g):
    dw, dh, w_like = residuals
    return (dh.astype(jnp.float32) * g).astype(dh.dtype), (dw * g).astype(w_like.dtype), None, None


head_loss_sum.defvjp(_head_loss_sum_fwd, _head_loss_sum_bwd)


def head_loss_bins(h, w, targets, mask, bins, num_bins: int, spmd=None):
    """(loss sums ``[num_bins]``, target counts ``[num_bins]``): :func:`head_loss_sum` split by each
    token's bin (``bins``, int in ``[0, num_bins)``, shaped like ``targets``), in the same one pass
    over the tiles; forward only (evaluation). Under ``spmd`` the bin travels in the mask's place:
    each token's ``mask · (bin + 1)``, 0 where it has no target."""
    code = mask.astype(jnp.float32) * (bins.astype(jnp.float32) + 1.0)
    fn = functools.partial(_local_bins, num_bins)
    sums = fn(h, w, targets, code) if spmd is None else spmd(fn, False)(h, w, targets, code)
    return sums[0], sums[1]


def _local_bins(num_bins: int, h, w, targets, code):
    """One device's loss sums and target counts per bin, stacked ``[2, num_bins]`` (one array for the
    spmd's sum over devices); ``code``: each token's bin + 1, or 0."""
    h2, code = h.reshape(-1, h.shape[-1]), code.reshape(-1)
    counted = (code > 0).astype(jnp.float32)
    losses = whole_head_loss(h2, w, targets.reshape(-1), counted)
    which = jnp.clip(code.astype(jnp.int32) - 1, 0, num_bins - 1)
    return jnp.stack([jax.ops.segment_sum(losses, which, num_bins), jax.ops.segment_sum(counted, which, num_bins)])
