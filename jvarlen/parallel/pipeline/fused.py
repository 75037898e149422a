"""Lane 0's fused F and B of one chunk in a pipeline signature without context, as one ``jax.vjp``
of the stage (a method of :class:`jvarlen.parallel.pipeline.executor.StageProgram`; device code).
Where the step adds each layer's gradients as it descends (``StageProgram.per_layer``, a GPU
step's form) the fused op runs as passes instead: this form returns the stage's gradients stacked."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jvarlen.parallel.pipeline import slots


def fused_op(self, r, k) -> dict:
    """Lane 0's fused F and B of chunk k in a signature without context, where the stage's
    weights are whole on every device: one ``jax.vjp`` of the scan over the stage's layers,
    applied to the head's cotangent at once. Its residuals never leave the op, so autodiff keeps
    them as the data-parallel step's scan does, where the passes of :meth:`StageProgram.backward_op` keep
    each layer's ``vjp`` leaves (CPU, one stage, 4 × 512 tokens: +0.1 / −7.2 % against the
    data-parallel step instead of +6-7 %; docs/design/residuals.md). Sharded weights take the passes, whose
    gathers autodiff would keep as residuals, and so do signatures with context, whose passes
    read each layer's context rows in place where this would stack them over the layers."""
    s, fns, c = self.s, self.s.fns, self.chunk(k)
    f = fns.layer(c["inputs"], c["local_positions"])
    x = self.rest.embed(c, after=r["x"]) if s.pp == 1 else r["x"]
    ck, cv = slots.context_of(s, r, c, 0)  # no context: [0, K, D] each

    def forward(weights, x):
        return jax.lax.scan(lambda x, lp: (f(lp, x, ck, cv)[0], None), x, weights)[0]

    y, vjp_fn = jax.vjp(forward, self.layers, x)
    loss, d_head, dy = self.rest.head_vjp(c, y)
    d_layers, dx = vjp_fn(dy)
    return dict(
        self.out,
        send_grad=dx,
        lookup_cotangent=self.rest.lookup_cotangent(dx, self.is_first),
        d_layers=d_layers,
        d_head=d_head,
        loss=loss,
        count=jnp.asarray(s.ls, jnp.int32),
    )
