"""Next-token cross-entropy on packed rows, as sums plus token counts."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy_sums(logits_btv: jax.Array, targets_bt: jax.Array, loss_mask_bt: jax.Array) -> dict:
    """Sum of token losses and the number of real targets.

    ``loss_mask`` is 1 only where ``targets`` is the next token of the same document,
    so no target crosses a document boundary and padding contributes nothing.
    """
    logits = logits_btv.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets_bt[..., None].astype(jnp.int32), axis=-1)[..., 0]
    mask = loss_mask_bt.astype(jnp.float32)
    return {
        "loss_sum": jnp.sum((log_z - target_logit) * mask),
        "target_tokens": jnp.sum(mask),
    }
