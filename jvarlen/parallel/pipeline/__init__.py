"""The elastic pipeline executor: plans of chunks through ``pp`` stages in one compiled program.

Host side (numpy): :mod:`.chunks` (plan pieces -> packed chunks), :mod:`jvarlen.plan.buffers` (slot tables),
:mod:`.signature` (the static key of a compiled step), :mod:`.prepare` (one step's inputs).
Device side: :mod:`.stage` (a stage's layers with stored or recomputed residuals),
:mod:`.rest` (the embedding, final norm and head, whole or split by vocabulary over sp),
:mod:`.executor` (the tick program), :mod:`.grads` (a step's gradients, of one plan or of a step's
parts). docs/design/pipeline.md describes the whole.
"""

from jvarlen.parallel.pipeline.chunks import PackedChunks, chunk_links, pack_chunks
from jvarlen.parallel.pipeline.executor import split_params
from jvarlen.parallel.pipeline.grads import make_pipeline_grads
from jvarlen.parallel.pipeline.prepare import pad_plan, prepare_batch, prepare_plans, split_documents
from jvarlen.parallel.pipeline.signature import CHUNK_KEYS, PipelineSignature, cover, covers, round_signature

__all__ = [
    "CHUNK_KEYS",
    "PackedChunks",
    "PipelineSignature",
    "chunk_links",
    "cover",
    "covers",
    "make_pipeline_grads",
    "pack_chunks",
    "pad_plan",
    "prepare_batch",
    "prepare_plans",
    "round_signature",
    "split_documents",
    "split_params",
]
