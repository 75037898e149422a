"""The rest of the model (embedding table, final norm, head) inside the pipeline executor: the
embedding of the first stage's input, the head and loss of the last stage's output and their
gradients, whole on every device or split by vocabulary over the stage's sp devices.

Every device of the pipeline executor holds the rest (one program runs on every stage); whole it
costs each device ~12 bytes per embedding or head parameter, whatever its stage
(docs/benchmarks.md, "The embedding and head on every pipeline device"). Split by vocabulary over
the stage's ``sp`` devices (the devices that run the same chunk), a device holds ``1/sp`` of the
table, the head and their accumulators, and nothing table-sized moves in the step's ticks: each
device works on its rows for all ``T`` tokens of the chunk, and activations move instead
(:class:`VocabShard`; the hand-over before the ticks: :func:`hand_rest`):

- lookup: each device takes its rows of the chunk's tokens (zeros for the others) and a
  reduce-scatter over ``sp`` hands every device the embeddings of its ``T/sp`` tokens;
- the lookup's gradient: the first stage's input cotangents, all-gathered over ``sp``, are
  scatter-added into the local rows;
- the head: the normed outputs are all-gathered, each device computes its ``[T, V/sp]`` logits
  (as many as ``[T/sp, V]`` whole), the log-partition is a max and a sum over ``sp``, and the
  gradient is written out (softmax minus one-hot): the head's is local, the outputs' is
  reduce-scattered back. No collective is differentiated by JAX.

The executor splits where ``sp`` divides the vocabulary and the sp devices share a node
(``Layout.vocab_shards``; the runtime's strategies pass the profile's ``gpus_per_node``): across
nodes each op's ``[T, d]`` collectives cost more time than the memory saved is worth (7-24 % of a
7B micro-batch at sp = 16-32 in the analytic profiles, docs/design/cost-model.md). A device
group's program takes each device's rows, which a small program on the group's devices keeps of
the pulled copy, and each device returns its rows of the gradients, which another puts in place
in a whole row (``group_exchange.Exchange.compile_rest_in`` / ``compile_rest_out``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jvarlen.model.head import head_loss, whole_head_loss
from jvarlen.parallel.layouts import DP, PP, SP
from jvarlen.parallel.pipeline.stage import maybe

EMBED, HEAD = "embed", "head"  # the rest's table [V, d] and untied head [d, V] (jvarlen.model.transformer)
VOCAB_AXIS = {EMBED: 0, HEAD: 1}


def vocab_axes(rest, shards: int) -> list:
    """Per leaf of ``rest`` (``jax.tree.leaves`` order), the axis it is split on by vocabulary over
    ``sp`` inside the executor (where ``shards > 1``: the table and an untied head), or None."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(rest)[0]]
    return [VOCAB_AXIS.get(getattr(path[0], "key", None)) if shards > 1 else None for path in paths]


def rest_specs(rest, shards: int):
    """Partition specs of the rest's leaves inside the executor (:func:`vocab_axes`): the table and
    head split by vocabulary over ``sp`` where ``shards > 1``, everything else replicated."""
    specs = [P() if a is None else P(*([None] * a + [SP])) for a in vocab_axes(rest, shards)]
    return jax.tree.structure(rest).unflatten(specs)


def hand_rest(rest, mesh, shards: int):
    """``rest`` on its way into the executor (inside ``jit``, before ``shard_map``): split by
    vocabulary over every device first, so that the move to the executor's split over sp
    (:func:`rest_specs`) is an all-gather of ``1/sp`` of the table over dp and pp. Without it XLA
    moved the canonical state's chunks (split on the model dimension) by gathering the whole
    table and head in fp32 on every device and slicing them: 4.2 GB per device at a 128K
    vocabulary on llama-7b's width (docs/benchmarks.md). Leaves the other devices do not divide,
    and a rest that is not split, are left as they are. For GPUs: XLA:CPU's step held more with it
    than without (the tiny model of tests/test_pipeline_vocab.py: +1.0 MB of temporaries)."""
    if shards <= 1:
        return rest
    n = math.prod(mesh.shape.values())

    def place(x, axis):
        if axis is None or x.shape[axis] % n:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*([None] * axis + [(SP, DP, PP)]))))

    leaves, treedef = jax.tree.flatten(rest)
    return treedef.unflatten([place(x, axis) for x, axis in zip(leaves, vocab_axes(rest, shards))])


class VocabShard:
    """This device's rows of the vocabulary: ``[offset, offset + size)`` (inside ``shard_map``)."""

    def __init__(self, vocab_size: int, shards: int):
        self.size = vocab_size // shards
        self.offset = jax.lax.axis_index(SP) * self.size

    def local(self, tokens):
        """(row of each token in this device's rows, whether it is one of them)."""
        row = tokens - self.offset
        return row, (row >= 0) & (row < self.size)

    def lookup(self, table, tokens, dtype):
        """Embeddings of this device's ``T/sp`` tokens of the chunk, from its rows ``table [V/sp, d]``
        and all ``T`` tokens: exact, one device contributes each token's row."""
        row, mine = self.local(tokens)
        rows = jnp.take(table, jnp.clip(row, 0, self.size - 1), axis=0).astype(dtype)
        rows = jnp.where(mine[:, None], rows, jnp.zeros_like(rows))
        return jax.lax.psum_scatter(rows, SP, scatter_dimension=0, tiled=True)

    def gather_cotangent(self, dx):
        """All ``T`` cotangents of the chunk's lookup from this device's ``T/sp`` ``dx``: each
        device adds the rows of its vocabulary for every token of the chunk."""
        return jax.lax.all_gather(dx, SP, axis=0, tiled=True)

    def table_rows(self, tokens, takes):
        """Row index of each of the chunk's ``T`` tokens in this device's rows, for the lookup's
        gradient where ``takes``; rows of other devices' vocabulary, and every row where not
        ``takes``, index past the table (drop them with ``mode="drop"``)."""
        row, mine = self.local(tokens)
        return jnp.where(mine & takes, row, self.size)

    def head_loss(self, h, w, targets, mask, scale, mine, tokens: int):
        """Cross-entropy of the chunk's normed outputs ``h [T/sp, d]`` (this device's) against
        ``w [d, V/sp]`` (its columns of the head, in the compute dtype), as
        ``jvarlen.model.cross_entropy_sums`` computes it on the whole logits, and its gradient at
        cotangent ``scale``: (sum of this device's ``tokens`` token losses from ``mine``, the
        gradient of ``w`` (fp32), of ``h``). ``targets`` and ``mask`` are the whole chunk's. A tile of the
        ``T`` tokens at a time (:func:`jvarlen.model.head.head_loss`), each tile's log-partition a
        max and a sum over sp."""
        h_all = jax.lax.all_gather(h, SP, axis=0, tiled=True)
        row, hit = self.local(targets)
        losses, dw, dh_all = head_loss(h_all, w, row, hit, mask, grad_scale=scale, combine=combine_over_sp)
        loss = jnp.sum(jax.lax.dynamic_slice_in_dim(losses, mine, tokens))
        dh = jax.lax.psum_scatter(dh_all, SP, scatter_dimension=0, tiled=True)
        return loss, dw, dh.astype(h.dtype)


def combine_over_sp(top, sum_exp, at_target):
    """(log-partition, target logit) per token from each sp device's statistics over its columns."""
    top_all = jax.lax.pmax(top, SP)
    # one sum over sp for both, after the max: collectives that do not depend on each other may
    # start in a different order on each device (XLA:CPU), which deadlocks
    sums = jnp.stack([sum_exp * jnp.exp(top - top_all), at_target])
    sum_all, target = jax.lax.psum(sums, SP)
    return top_all + jnp.log(sum_all), target


class StageRest:
    """The rest of the model as one device of the executor uses it (inside ``shard_map``):
    ``graphdef`` and the stage's ``layers`` (to rebuild the model), ``rest`` (this device's
    leaves), the compute ``dtype``, the loss ``scale`` (1 / all real targets of the iteration),
    ``shards`` (:attr:`StageShapes.vocab_shards`), this device's ``tokens`` of a chunk from token
    ``mine``, and whether collectives are ``ordered`` (the executor's tick)."""

    def __init__(self, graphdef, layers, rest, dtype, scale, shards: int, mine, tokens: int, ordered: bool):
        self.graphdef, self.layers, self.rest, self.dtype, self.scale = graphdef, layers, rest, dtype, scale
        self.mine, self.tokens, self.ordered = mine, tokens, ordered
        config = self.model_of(rest).config
        self.tied = config.tie_embeddings
        # what the head differentiates (final norm, head; the table when tied): all an op returns of the rest's
        self.head_keys = tuple(k for k in rest.keys() if k != EMBED or self.tied)
        self.norm_keys = tuple(k for k in rest.keys() if k not in (EMBED, HEAD))  # the final norm's
        self.vocab = VocabShard(config.vocab_size, shards) if shards > 1 else None  # None: whole

    def model_of(self, rest):
        return nnx.merge(self.graphdef, rest, nnx.State({"layers": self.layers}))

    def part(self, keys) -> nnx.State:
        return nnx.State({k: self.rest[k] for k in keys})

    def with_part(self, part: nnx.State) -> nnx.State:  # the rest with ``part`` (differentiated) in it
        return nnx.State({**self.rest, **part})

    def embed(self, c, rest=None, after=None):
        """The embeddings of this device's tokens of chunk view ``c``. Split by vocabulary, the
        lookup is a collective: ``after``, a value it then waits for (see the executor's tick)."""
        model = self.model_of(self.rest if rest is None else rest)
        if self.vocab is None:
            return model.embed_tokens(c["local_tokens"][None])[0]
        tokens = c["tokens"]
        if self.ordered and after is not None:
            tokens, _ = jax.lax.optimization_barrier((tokens, after))
        return self.vocab.lookup(model.embed[...], tokens, self.dtype)

    def head_vjp(self, c, y):
        """(loss, its gradients of :attr:`head_keys` and of ``y``) of chunk view ``c``'s last-stage
        output: the loss and its gradient in one pass (:func:`jvarlen.model.head.head_loss`, split
        by vocabulary: ``VocabShard.head_loss``), the final norm's by JAX."""
        h, norm_vjp = jax.vjp(
            lambda nn, yy: self.model_of(self.with_part(nn)).final_norm(yy), self.part(self.norm_keys), y
        )
        w = self.model_of(self.rest).head_weights()
        if self.vocab is None:
            losses, dw, dh = whole_head_loss(h, w, c["local_targets"], c["local_loss_mask"], grad_scale=self.scale)
            loss = jnp.sum(losses)
        else:
            loss, dw, dh = self.vocab.head_loss(h, w, c["targets"], c["loss_mask"], self.scale, self.mine, self.tokens)
        d_norm, dy = norm_vjp(dh)
        key = EMBED if self.tied else HEAD
        d_w = jax.tree.map(lambda p: (dw.T if self.tied else dw).astype(p.dtype), self.part((key,)))
        return loss, nnx.State({k: d_norm[k] if k in self.norm_keys else d_w[k] for k in self.head_keys}), dy

    def lookup_cotangent(self, dx, takes):
        """What :meth:`embed_grad` needs of the first stage's input cotangent ``dx``, inside the
        op's conditional (where ``takes``: the op sends one, zeros elsewhere): ``dx`` itself, or,
        split by vocabulary, the chunk's ``T`` cotangents gathered over sp. In the op, after its
        last collective, the gather is ordered by data like the op's others. As its own
        conditional after the op's, the two devices of an sp pair deadlocked on XLA:CPU, one in
        this all-gather and the other in an all-reduce inside another conditional (layout
        (2, 1, 2), 1F1B); unconditional, it ran on every tick of every stage."""
        if self.vocab is None:
            return dx
        return maybe(takes, lambda: self.vocab.gather_cotangent(dx))

    def embed_grad(self, g_rest: nnx.State, c, cotangent, takes) -> nnx.State:
        """``g_rest`` with the embedding table's gradient added of ``cotangent``
        (:meth:`lookup_cotangent`; where ``takes``). Outside the op's conditional (whose output
        would be table-sized): XLA scatter-adds it into the accumulator in place."""
        if self.vocab is None:
            dx = jnp.where(takes, cotangent, jnp.zeros_like(cotangent))
            _, vjp_fn = jax.vjp(lambda ee: self.embed(c, self.with_part(ee)), self.part((EMBED,)))
            return add_part(g_rest, vjp_fn(dx)[0])
        row = self.vocab.table_rows(c["tokens"], takes)
        table = jax.tree.map(lambda g: g.at[row].add(cotangent.astype(g.dtype), mode="drop"), g_rest[EMBED])
        return nnx.State({**g_rest, EMBED: table})

    def head_zeros(self) -> nnx.State:
        """Zeros of an op's gradient of the rest (:attr:`head_keys`)."""
        return jax.tree.map(jnp.zeros_like, self.part(self.head_keys))

    def accumulators(self) -> nnx.State:
        """Zero gradient accumulators of the rest: in fp32 at least, whatever dtype a leaf arrives
        in (a device group's pull hands the head in the compute dtype), as the layers' are; each
        op's gradient stays in the leaf's dtype and is added into them."""

        def zeros(x):
            floating = jnp.issubdtype(x.dtype, jnp.floating)
            return jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32) if floating else x.dtype)

        return jax.tree.map(zeros, self.rest)

    def sum_over_layout(self, g_rest: nnx.State, after, axes: tuple) -> tuple:
        """(``g_rest`` summed over the layout, the last sum): a split leaf over ``axes`` (the
        pipelines and stages), a whole one over the stage's sp devices too; one sum after the
        other, the first after ``after`` where collectives are ordered."""
        out, done = {}, after
        for k, g in g_rest.items():
            if self.ordered:
                _, g = jax.lax.optimization_barrier((done, g))
            split = self.vocab is not None and k in VOCAB_AXIS
            out[k] = done = jax.lax.psum(g, axes if split else axes + (SP,))
        return nnx.State(out), done


def add_part(acc: nnx.State, part: nnx.State) -> nnx.State:
    """``acc`` (the rest's accumulators) with ``part``'s gradients added into its entries."""
    return nnx.State({**acc, **{k: jax.tree.map(jnp.add, acc[k], part[k]) for k in part.keys()}})
