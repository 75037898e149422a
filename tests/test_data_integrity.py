"""Nothing lost between the data pipeline and the two training paths: a corpus document of n
tokens contributes exactly n - 1 next-token targets however ``data.max_doc_tokens`` cuts it into
pieces and however the planner slices and packs those pieces into chunks, and the data-parallel
packer and the pipeline's chunk packer train the same (input, target) pairs."""

from __future__ import annotations

import collections

import jax
import numpy as np
from conftest import require_devices, values_compile
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_helpers import PipelineGrads, tiny_config, tiny_params

from jvarlen.data.packer import Piece, pack, place
from jvarlen.data.split import split_documents
from jvarlen.layout import Layout
from jvarlen.parallel.pipeline import chunk_links, pack_chunks, prepare_batch
from jvarlen.plan import schedule as sch
from jvarlen.runtime.step import loss_sums


def corpus_pieces(lengths, max_doc_tokens, first_token=1):
    """Pieces of a corpus whose token values are unique (the corpus offset + first_token), so an
    (input, target) pair names one position of one document."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.arange(offsets[-1], dtype=np.int64) + first_token
    table, _ = split_documents(np.asarray(lengths), max_doc_tokens)
    pieces = []
    for d, s, n, more in zip(table.doc, table.start, table.length, table.has_next):
        a = offsets[d] + s
        pieces.append(Piece(tokens[a : a + n], int(d), int(tokens[a + n]) if more else -1))
    return pieces


def random_chunks(pieces, rng):
    """A chunk plan of the pipeline path over ``pieces`` (the planner's documents): each piece is
    cut into 1-3 slices, a split piece's slices in chunks of their own (the last one packed with
    whole short pieces now and then), the other pieces packed a few per chunk."""
    chunks, loose = [], []
    for d, p in enumerate(pieces):
        n = len(p.tokens)
        cuts = sorted(set(rng.integers(1, n, size=rng.integers(0, 3)).tolist())) if n > 1 else []
        if not cuts:
            loose.append((d, 0, n))
            continue
        bounds = [0, *cuts, n]
        for a, b in zip(bounds[:-1], bounds[1:]):
            chunks.append([(d, a, b - a)])
    rng.shuffle(loose)
    while loose:
        take = loose[: rng.integers(1, 4)]
        loose = loose[len(take) :]
        tails = [c for c in chunks if c[0][1] > 0 and len(c) == 1]
        if tails and rng.random() < 0.5:
            tail = tails[rng.integers(len(tails))]
            d, s, n = tail[0]
            if s + n == len(pieces[d].tokens):  # only a document's last slice may take company
                tail.extend(take)
                continue
        chunks.append(list(take))
    # slices of a document in order: the executor needs a slice's context chunk first
    order = sorted(
        range(len(chunks)), key=lambda k: (chunks[k][0][0], chunks[k][0][1]) if chunks[k][0][1] > 0 else (-1, k)
    )
    return [chunks[k] for k in order]


def pairs(tokens, targets, mask):
    return collections.Counter(zip(np.asarray(tokens)[mask > 0].tolist(), np.asarray(targets)[mask > 0].tolist()))


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 90), min_size=1, max_size=12),
    max_doc_tokens=st.integers(2, 40),
    seed=st.integers(0, 2**16),
)
def test_both_paths_train_every_next_token_pair_exactly_once(lengths, max_doc_tokens, seed):
    pieces = corpus_pieces(lengths, max_doc_tokens)
    want = collections.Counter()
    offset = 1
    for n in lengths:
        want.update((t, t + 1) for t in range(offset, offset + n - 1))
        offset += n
    assert sum(want.values()) == sum(n - 1 for n in lengths)

    # data-parallel path: pieces packed into rows of max_doc_tokens
    rows = len(pieces)
    placement = place(np.array([len(p.tokens) for p in pieces]), rows, max_doc_tokens)
    dp = pack(pieces, rows, max_doc_tokens, placement)
    assert pairs(dp.tokens, dp.targets, dp.loss_mask) == want

    # pipeline path: the pieces are the planner's documents, sliced and packed into chunks
    chunks = random_chunks(pieces, np.random.default_rng(seed))
    bucket = max(sum(p[2] for p in c) for c in chunks)
    packed = pack_chunks(chunks, pieces, bucket)
    a = packed.arrays
    assert pairs(a["tokens"], a["targets"], a["loss_mask"]) == want
    assert int(a["loss_mask"].sum()) == int(dp.loss_mask.sum()) == sum(n - 1 for n in lengths)


def test_pipeline_loss_sums_equal_the_data_parallel_path_on_split_documents():
    """The same sampled pieces trained by the data-parallel packer and by the pipeline executor
    (2 stages, slices with context K/V) give the same loss sum over the same number of targets."""
    layout = Layout(dp=1, pp=2, sp=1)
    require_devices(layout.num_devices)
    cfg = tiny_config(num_layers=4)
    graphdef, params = tiny_params(cfg)
    rng = np.random.default_rng(3)
    lengths = [70, 12, 45, 30, 9, 61]
    pieces = [
        Piece(
            (p.tokens % (cfg.vocab_size - 1) + 1).astype(np.int32),
            p.doc_id,
            -1 if p.next_token < 0 else int(p.next_token % (cfg.vocab_size - 1) + 1),
        )
        for p in corpus_pieces(lengths, max_doc_tokens=32)
    ]
    assert sum(p.next_token >= 0 for p in pieces) == 4  # four split points

    placement = place(np.array([len(p.tokens) for p in pieces]), len(pieces), 32)
    batch = pack(pieces, len(pieces), 32, placement).as_dict()
    dp_sums = jax.jit(lambda p, b: loss_sums(graphdef, p, b))(params, batch)

    chunks = random_chunks(pieces, rng)
    bucket = -(-max(sum(p[2] for p in c) for c in chunks) // 8) * 8
    pack_ = pack_chunks(chunks, pieces, bucket)
    schedule = sch.gpipe(len(chunks), layout.pp, chunk_links(chunks))
    ckpt = np.zeros((len(chunks), layout.pp), np.int32)
    sig, arrays = prepare_batch([pack_], [schedule], [ckpt], layout, cfg.num_layers)
    sums, _, _ = PipelineGrads(graphdef, cfg, sig, params, compiler_options=values_compile())(params, arrays)
    assert float(sums["target_tokens"]) == float(dp_sums["target_tokens"]) == sum(n - 1 for n in lengths)
    np.testing.assert_allclose(float(sums["loss_sum"]), float(dp_sums["loss_sum"]), rtol=1e-5)
