"""Alg. 1 (InfiniPipe §3.2): slice mesh, split_seqs, BFD packing invariants."""

import numpy as np
import pytest
from conftest import small_cost

from jvarlen.plan.chunk import ChunkShape
from jvarlen.plan.cost import CostModel
from jvarlen.plan.hardware import H100, analytic_coefficients
from jvarlen.plan.sequence_processor import Mesh, bucket_mesh, chunk_batch, split_document, split_mesh
from jvarlen.plan.units import families_of
from jvarlen.plan.workloads import sample_batch

K = 1024


def test_split_document_follows_the_paper_example():
    # §3.2: with a mesh {8K, 4K, 2K}, documents longer than 12K become 8K, 4K and a remainder.
    mesh = Mesh((8 * K, 4 * K, 2 * K), 1.0, 8 * K)
    assert split_document(13 * K, mesh) == [8 * K, 4 * K, 1 * K]
    assert split_document(14 * K, mesh) == [8 * K, 4 * K, 2 * K]
    assert split_document(12 * K, mesh) == [8 * K, 4 * K]
    assert split_document(9 * K, mesh) == [8 * K, 1 * K]
    assert split_document(8 * K, mesh) == [8 * K]  # short
    assert split_document(100, mesh) == [100]


@pytest.mark.parametrize("n", [1, 2, 5])
def test_mesh_slices_have_equal_backward_time_and_shrink(n):
    cost = small_cost()
    length = 40_000
    mesh = split_mesh(cost, length, n)
    assert sum(mesh.slices) == length and len(mesh.slices) == n
    assert list(mesh.slices) == sorted(mesh.slices, reverse=True)  # later slices see a longer context
    times, ctx = [], 0
    for i, s in enumerate(mesh.slices):
        times.append(cost.bwd_time(ChunkShape(ctx, (s,), tail=i == n - 1)))
        ctx += s
    assert max(times) == pytest.approx(mesh.time_threshold)
    # Equal up to one token's worth of time (slices are integers) plus the smaller tail.
    assert max(times[:-1], default=times[0]) - min(times[:-1], default=times[0]) < 1e-3 * max(times)
    assert mesh.token_threshold == mesh.slices[0]


def test_a_cost_models_meshes_are_kept_and_are_what_the_bisection_gives():
    """The planner asks for one mesh per group and per batch: the cost model keeps it, equal to
    the bisection's; a cost model of other coefficients has its own."""
    from jvarlen.plan.sequence_processor import _split_mesh

    cost = small_cost()
    mesh = split_mesh(cost, 40_000, 5)
    assert split_mesh(cost, 40_000, 5) is mesh and mesh == _split_mesh(cost, 40_000, 5, 16)
    assert split_mesh(cost, 40_000, 6) == _split_mesh(cost, 40_000, 6, 16) != mesh
    faster = CostModel(cost.model, cost.layout, analytic_coefficients(cost.model, H100))  # small_cost: A800
    assert split_mesh(faster, 40_000, 5) == _split_mesh(faster, 40_000, 5, 16)
    assert split_mesh(faster, 40_000, 5).time_threshold < mesh.time_threshold


def _check_invariants(lengths, result, cost, max_perturbation):
    chunks = result.chunks
    # Token conservation: every token of every document exactly once.
    seen = {d: np.zeros(n, dtype=np.int64) for d, n in enumerate(lengths)}
    for c in chunks:
        for doc, start, length in c.pieces:
            seen[doc][start : start + length] += 1
    for d in seen:
        assert np.all(seen[d] == 1), f"document {d} not covered exactly once"
    for c in chunks:
        # No two tails (or any two split slices) together; a split slice comes first.
        split = [p for p in c.pieces if not (p[1] == 0 and p[2] == lengths[p[0]])]
        assert len(split) <= 1
        if split:
            assert c.pieces[0] == split[0]
        # Split chunks (non-tail slices) stay alone.
        shape = c.shape(lengths)
        if not shape.tail:
            assert len(c.pieces) == 1
        # Thresholds.
        assert c.tokens <= result.token_threshold
        assert cost.bwd_time(shape) <= result.time_threshold * (1 + 1e-12)
    tau = result.mesh.time_threshold
    assert result.time_threshold >= tau
    if max_perturbation is not None:
        assert result.time_threshold <= (1 + max_perturbation) * tau * (1 + 1e-12)
    families_of(chunks, lengths)  # raises if a slice is not the first piece


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_perturbation", [0.05, None])
def test_alg1_invariants_on_random_batches(seed, max_perturbation):
    cost = small_cost()
    lengths = sample_batch("github", 96, 32 * K, seed=seed)
    for n in (1, 3, 6):
        result = chunk_batch(lengths, cost, n, max_perturbation=max_perturbation)
        _check_invariants(lengths, result, cost, max_perturbation)
        # Split documents are cut exactly along the mesh.
        for c in result.chunks:
            doc, start, length = c.pieces[0]
            if not c.shape(lengths).tail:
                assert length in result.mesh.slices


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("tokens", [1024, 3000, 8192, 0])
def test_bucket_mesh_fills_its_slices_and_chunks_stay_within_them(seed, tokens):
    """The bucket mesh (for an executor that pads chunks to one bucket): the longest document in
    slices of exactly ``tokens`` and a shorter rest (whole if it is no longer); Alg. 1's
    invariants hold and no chunk, split or packed, has more tokens than a slice."""
    cost = small_cost()
    lengths = sample_batch("github", 96, 32 * K, seed=seed)
    tokens = tokens or 2 * max(lengths)  # 0: larger than every document, so nothing is split
    mesh = bucket_mesh(cost, max(lengths), tokens)
    assert sum(mesh.slices) == max(lengths) and mesh.token_threshold == tokens
    assert set(mesh.slices[:-1]) <= {tokens} and 0 < mesh.slices[-1] <= tokens
    times, ctx = [cost.bwd_time(ChunkShape(0, (tokens,)))], 0  # a full chunk of one document, too
    for i, s in enumerate(mesh.slices):
        times.append(cost.bwd_time(ChunkShape(ctx, (s,), tail=i == len(mesh.slices) - 1)))
        ctx += s
    assert mesh.time_threshold == pytest.approx(max(times))
    result = chunk_batch(lengths, cost, 1, slice_tokens=tokens)
    assert result.mesh == mesh
    _check_invariants(lengths, result, cost, 0.05)
    assert max(c.tokens for c in result.chunks) <= tokens
    for c in result.chunks:  # split documents are cut into whole slices
        if not c.shape(lengths).tail:
            assert c.tokens == tokens


def test_bucket_mesh_rejects_slices_over_the_capacity():
    with pytest.raises(ValueError, match="slices of 4096 tokens.*use shorter slices"):
        chunk_batch([30_000, 500], small_cost(), 1, token_capacity=2_000, slice_tokens=4096)


def test_token_capacity_caps_the_token_threshold_and_rejects_too_coarse_meshes():
    cost = small_cost()
    lengths = [30_000, 500, 700, 9_000]
    with pytest.raises(ValueError, match="raise n_slices"):
        chunk_batch(lengths, cost, 1, token_capacity=10_000)
    result = chunk_batch(lengths, cost, 8, token_capacity=10_000)
    assert result.token_threshold <= 10_000
    assert all(c.tokens <= 10_000 for c in result.chunks)


def test_packing_prefers_low_time_per_token_buckets():
    # Two tail buckets: one continues a long context (high time/token), one is a short
    # document bucket. A small document should join the bucket with lower time/token.
    cost = small_cost()
    lengths = [24_000, 4_000, 300]
    result = chunk_batch(lengths, cost, 3, max_perturbation=None)
    holder = [c for c in result.chunks if any(p[0] == 2 for p in c.pieces)][0]
    others = [c for c in result.chunks if c is not holder and c.shape(lengths).tail]
    ratio = lambda c: cost.bwd_time(c.shape(lengths)) / c.tokens  # noqa: E731
    holder_before = [p for p in holder.pieces if p[0] != 2]
    if holder_before and others:
        from jvarlen.plan.units import PlannedChunk

        before = PlannedChunk(tuple(holder_before))
        assert all(ratio(before) <= ratio(o) + 1e-15 for o in others)


def test_pack_tokens_caps_packing_and_long_unsplit_documents_stay_alone():
    cost = small_cost()
    lengths = [20_000, 6_000, 3_000, 2_500, 1_000, 700, 300]
    result = chunk_batch(lengths, cost, 1, pack_tokens=5_000)  # N = 1: nothing is split
    assert result.token_threshold == 5_000
    for c in result.chunks:
        assert all(p[1] == 0 for p in c.pieces)
        if c.tokens > 5_000:
            assert len(c.pieces) == 1  # a long document alone, never packed with others
    assert sorted(p[0] for c in result.chunks for p in c.pieces) == list(range(len(lengths)))
