"""The static part of a pipeline step (the compile-cache key) and its input shapes.

Everything a plan decides at runtime (chunks, tick table, slot and recomputation tables) is
data; a :class:`PipelineSignature` holds only what shapes the compiled program. Nearby plans
share one executable: signatures are rounded up (:func:`round_signature`) and a compiled one
that :func:`covers` a plan's needs is reused.
"""

from __future__ import annotations

import dataclasses

from jvarlen.layout import Layout
from jvarlen.plan.buffers import CHUNK_KEYS, round_buffers, round_up

TABLE_KEYS = ("ops", "stash_slot", "grad_slot", "ctx_base", "res_slot", "ckpt_slot", "recv_act", "recv_grad")
GROWABLE = ("n_ticks", "context", "n_stash", "n_grad", "ctx_rows", "n_res", "n_ckpt", "fused")


@dataclasses.dataclass(frozen=True)
class PipelineSignature:
    """Everything that shapes the compiled step (the compiled-step cache key)."""

    layout: Layout
    num_layers: int
    bucket: int  # T, tokens per chunk
    n_chunks: int
    n_ticks: int
    context: int  # Sc, the context tokens one chunk may read (0: no split document)
    n_stash: int
    n_grad: int
    ctx_rows: int  # rows of the context pool: the split documents in flight (docs/design/pipeline-context-pool.md)
    n_res: int  # stored-layer residual slots per stage
    n_ckpt: int = 0  # recomputed layers' input slots per stage (layers 1.. of the recomputed ones)
    fused: bool = True  # some op runs a chunk's F and B fused (the program holds the fused op)

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.layout.pp

    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the int32 device inputs :func:`jvarlen.parallel.pipeline.prepare_batch` builds."""
        dp, pp, n = self.layout.dp, self.layout.pp, self.n_chunks
        shapes = {key: (dp, n, self.bucket) for key in CHUNK_KEYS}
        shapes.update(
            ctx_len=(dp, n),
            has_next=(dp, n),
            ops=(dp, self.n_ticks, pp, 2, 2),  # paired ticks: (op, chunk) of lane 0 (B/FUSED), lane 1 (F)
            stash_slot=(dp, n, pp),
            grad_slot=(dp, n, pp),
            ctx_base=(dp, n, pp),
            res_slot=(dp, n, pp, self.layers_per_stage),
            ckpt_slot=(dp, n, pp, self.layers_per_stage),
            recv_act=(dp, self.n_ticks, pp),
            recv_grad=(dp, self.n_ticks, pp),
            live_ticks=(dp,),  # ticks actually run (≤ n_ticks), the same for every pipeline
        )
        return shapes


def round_signature(sig: PipelineSignature) -> PipelineSignature:
    """Coarser signature so that nearby plans share one executable."""
    return dataclasses.replace(
        sig, n_ticks=round_up(sig.n_ticks, 8), **round_buffers(sig, sig.bucket, sig.layers_per_stage)
    )


def covers(big: PipelineSignature, small: PipelineSignature) -> bool:
    """``big``'s buffers hold everything ``small`` needs (same layout, model, bucket and chunk count)."""
    same = ("layout", "num_layers", "bucket", "n_chunks")
    return all(getattr(big, f) == getattr(small, f) for f in same) and all(
        getattr(big, f) >= getattr(small, f) for f in GROWABLE
    )


def cover(*sigs: PipelineSignature) -> PipelineSignature:
    """The smallest signature every one of ``sigs`` (same layout, model, bucket, chunk count) fits into."""
    return dataclasses.replace(sigs[0], **{f: max(getattr(s, f) for s in sigs) for f in GROWABLE})
