"""The head's loss a tile of tokens at a time (jvarlen.model.head) against the whole logits'
``cross_entropy_sums`` under ``jax.grad``, whole, split by vocabulary over sp, and per device of
the fused step's mesh; and the memory the tiles bound."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tile_head_logits
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jvarlen import head_tiles
from jvarlen.model import cross_entropy_sums
from jvarlen.model.head import head_loss, head_loss_bins, head_loss_sum
from jvarlen.parallel.layouts import SP
from jvarlen.parallel.pipeline.rest import VocabShard

D, V = 16, 48


def _inputs(n: int, seed: int = 0):
    k = jax.random.split(jax.random.key(seed), 4)
    h = jax.random.normal(k[0], (n, D), jnp.float32)
    w = 0.3 * jax.random.normal(k[1], (D, V), jnp.float32)
    targets = jax.random.randint(k[2], (n,), 0, V)
    mask = (jax.random.uniform(k[3], (n,)) > 0.25).astype(jnp.float32)
    return h, w, targets, mask


def _reference(h, w, targets, mask):
    logits = jnp.einsum("td,dv->tv", h, w, preferred_element_type=jnp.float32)
    return cross_entropy_sums(logits[None], targets[None], mask[None])["loss_sum"]


def _tile_rows(monkeypatch, rows: int, columns: int = V):
    tile_head_logits(monkeypatch, rows * columns)


def test_tiles_cover_the_rows():
    tile = 4 * 1000 * 100  # 100 rows of 1000 columns
    assert head_tiles.logits_tiles(100, 1000, 0, tile) == (1, 100)
    assert head_tiles.logits_tiles(101, 1000, 0, tile) == (2, 51)
    # tiling adds the gradient's fp32 sum [width, columns]: one tile while that would hold as much
    assert head_tiles.logits_tiles(130, 1000, 30, tile) == (1, 130)
    assert head_tiles.logits_tiles(131, 1000, 30, tile) == (2, 66)
    assert head_tiles.logits_tiles(7, 10**9, 0, 4) == (7, 1)  # a row per tile at least
    for rows in range(1, 60):
        tiles, size = head_tiles.logits_tiles(rows, 3, 0, 4 * 3 * 8)
        assert tiles * size >= rows > (tiles - 1) * size and size <= 8


@pytest.mark.parametrize("tile", [1000, 16, 7, 1])  # one tile; 4 tiles; 10 with 6 padding rows; a row each
def test_tiled_loss_and_gradients_equal_the_whole_logits(monkeypatch, tile):
    _tile_rows(monkeypatch, tile)
    h, w, targets, mask = _inputs(64)
    fn = jax.jit(jax.value_and_grad(lambda h, w: 0.37 * head_loss_sum(h, w, targets, mask), argnums=(0, 1)))
    loss, (dh, dw) = fn(h, w)
    want, (dh_ref, dw_ref) = jax.value_and_grad(lambda h, w: 0.37 * _reference(h, w, targets, mask), argnums=(0, 1))(
        h, w
    )
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(dh, dh_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-7)
    assert not np.any(np.asarray(dh)[np.asarray(mask) == 0])  # no target, no gradient
    # without a gradient asked, the forward alone
    np.testing.assert_allclose(jax.jit(lambda h, w: head_loss_sum(h, w, targets, mask))(h, w), want / 0.37, rtol=1e-6)


def test_the_split_head_in_tiles_equals_the_whole_logits(monkeypatch):
    """``VocabShard.head_loss`` over sp = 2 with 24 columns per device in tiles of 5 of the 32
    gathered tokens (7 tiles, 3 padding rows): each tile's log-partition combined over sp."""
    sp = 2
    if jax.device_count() < sp:
        pytest.skip("needs 2 devices")
    _tile_rows(monkeypatch, 5, V // sp)
    h, w, targets, mask = _inputs(32, seed=1)
    mesh = Mesh(np.array(jax.devices()[:sp]), (SP,))

    def split(h, w, targets, mask):
        tokens = h.shape[0]
        loss, dw, dh = VocabShard(V, sp).head_loss(
            h, w, targets, mask, jnp.float32(0.37), jax.lax.axis_index(SP) * tokens, tokens
        )
        return jax.lax.psum(loss, SP), dw, dh

    run = jax.jit(
        jax.shard_map(
            split,
            mesh=mesh,
            in_specs=(P(SP), P(None, SP), P(), P()),
            out_specs=(P(), P(None, SP), P(SP)),
            check_vma=False,
        )
    )
    loss, dw, dh = run(h, w, targets, mask)
    want, (dh_ref, dw_ref) = jax.value_and_grad(lambda h, w: _reference(h, w, targets, mask), argnums=(0, 1))(h, w)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(dh, 0.37 * dh_ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, 0.37 * dw_ref, rtol=1e-5, atol=1e-7)


def test_only_one_tile_of_logits_is_held(monkeypatch):
    """Compiled (XLA:CPU), the tiled head's temporaries grow with the tokens by the ``[N, d]``
    outputs' gradient, not by the logits: under 1 byte per logit added (the whole logits under
    ``jax.grad`` add their fp32 values and gradient, 8 bytes), with tiles of 256 rows."""
    v = 2048
    _tile_rows(monkeypatch, 256, v)

    def temp(fn, n):
        h, w = jax.ShapeDtypeStruct((n, D), jnp.float32), jax.ShapeDtypeStruct((D, v), jnp.float32)
        ints = jax.ShapeDtypeStruct((n,), jnp.int32)
        grad = jax.jit(jax.grad(fn, argnums=(0, 1)))
        return (
            grad.lower(h, w, ints, jax.ShapeDtypeStruct((n,), jnp.float32))
            .compile()
            .memory_analysis()
            .temp_size_in_bytes
        )

    n0, n1 = 4096, 8192
    tiled = temp(head_loss_sum, n1) - temp(head_loss_sum, n0)
    whole = temp(_reference, n1) - temp(_reference, n0)
    assert tiled < (n1 - n0) * v, tiled
    assert whole >= 8 * (n1 - n0) * v, whole


def test_the_loss_without_gradients_is_the_same_pass(monkeypatch):
    """``head_loss`` without ``grad_scale`` returns the losses alone, equal to the ones with it."""
    _tile_rows(monkeypatch, 8)
    h, w, targets, mask = _inputs(30, seed=2)
    hit = jnp.ones_like(targets, bool)
    losses = head_loss(h, w, targets, hit, mask)
    with_grads, _, _ = head_loss(h, w, targets, hit, mask, grad_scale=jnp.float32(1.0))
    np.testing.assert_array_equal(losses, with_grads)
    assert losses.shape == (30,)


def test_the_loss_by_bins_is_the_loss_of_each_bins_tokens():
    """head_loss_bins (evaluation's loss by position): each bin's sum and count equal head_loss_sum
    with the mask cut to that bin's tokens, in one pass; a token without a target counts nowhere."""
    h, w, targets, mask = _inputs(40)
    bins = jnp.asarray(np.random.default_rng(1).integers(0, 3, 40), jnp.int32)
    sums, counts = head_loss_bins(h, w, targets, mask, bins, 3)
    for k in range(3):
        cut = mask * (bins == k)
        np.testing.assert_allclose(sums[k], head_loss_sum(h, w, targets, cut), rtol=1e-6)
        assert counts[k] == jnp.sum(cut)
    assert float(jnp.sum(counts)) == float(jnp.sum(mask)) < 40
