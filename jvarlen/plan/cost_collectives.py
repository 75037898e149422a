"""The pipeline executor's collectives beyond the Ulysses all-to-alls, in seconds: the gathers and
reduce-scatters of sharded stage weights (InfiniPipe §4's tailored FSDP; docs/design/pipeline.md,
"Stage weights") and those of the embedding table and head split by vocabulary over sp
(``jvarlen.parallel.pipeline.rest``). A mixin of :class:`jvarlen.plan.cost.CostModel`, which
holds the layout, coefficients, model shape and the memoized per-layer gather and reduce-scatter
times it uses."""

from __future__ import annotations

from typing import Optional

from jvarlen.plan.chunk import ChunkShape


class CollectiveTimes:
    # ---- sharded stage weights: the per-layer gathers and reduce-scatters of the executor
    def _group_collective_time(self, nbytes: float) -> float:
        """Seconds of an all-gather (or reduce-scatter) of ``nbytes`` over a stage's ``dp x sp``
        devices (mesh order ``(dp, pp, sp)``, ``sp`` fastest; the slowest stage decides): each
        device takes in the ``(g-1)/g`` it lacks over its NVLink share (``p2p_intra``), and a node
        holding ``m`` of the ``g`` devices takes in the ``1 - m/g`` held elsewhere once, over its
        ``m`` devices' network shares (``p2p_inter``: a hierarchical collective sends each byte
        into a node once, not once per device); the slower of the two, plus one latency."""
        c, (dp, pp, sp) = self.coeffs, (self.layout.dp, self.layout.pp, self.layout.sp)
        g = dp * sp
        worst = 0.0
        for p in range(pp):
            per_node: dict[int, int] = {}
            for d in range(dp):
                for i in range((d * pp + p) * sp, (d * pp + p + 1) * sp):
                    per_node[i // c.gpus_per_node] = per_node.get(i // c.gpus_per_node, 0) + 1
            t = (g - 1) / g * nbytes / c.p2p_intra.bandwidth
            if len(per_node) > 1:
                inter = max((1 - m / g) * nbytes / (m * c.p2p_inter.bandwidth) for m in per_node.values())
                t = max(t, inter) + c.p2p_inter.latency
            else:
                t += c.p2p_intra.latency
            worst = max(worst, t)
        return worst

    def _weight_comm_times(self) -> tuple[float, float]:
        if not self.stage_weights_sharded or self.layout.dp * self.layout.sp == 1:
            return 0.0, 0.0
        c, n = self.coeffs, self.model.layer_params
        accumulator = c.stage_bytes_per_param - c.bytes_per_element
        return self._group_collective_time(c.bytes_per_element * n), self._group_collective_time(accumulator * n)

    def weight_comm_times(self) -> tuple[float, float]:
        """Seconds of one decoder layer's all-gather (its weights in the compute dtype, ``e`` bytes
        per parameter) and of its gradient's reduce-scatter (in the accumulator's dtype,
        ``stage_bytes_per_param - e`` bytes) over the stage's ``dp x sp`` devices with sharded
        stage weights (:meth:`_group_collective_time`); ``(0, 0)`` with replicated ones."""
        return self._gather_s, self._reduce_s

    def weights_fwd_exposed(self, chunk: ChunkShape) -> float:
        """Seconds a forward pass over the stage's layers waits for sharded weights: the executor
        gathers layer ``j + 1`` while layer ``j`` computes (docs/design/pipeline.md, "Stage
        weights"), so the first gather is exposed and each layer takes
        ``max(compute, gather)``: ``gather + L_s · max(0, gather - layer forward)``. The
        all-to-alls stay on the critical path (:meth:`alltoall_time`), not behind the gathers."""
        g = self._gather_s
        if g <= 0:
            return 0.0
        return g + self.layers_per_stage * max(0.0, g - self.layer_fwd_compute(chunk))

    def weights_bwd_exposed(self, chunk: ChunkShape) -> float:
        """:meth:`weights_fwd_exposed` of the backward's descending pass: the next layer's gather
        and the previous layer's reduce-scatter are in flight over a layer's backward, the first
        gather and the last reduce-scatter are exposed. Recomputation hides more
        (:meth:`recompute_time`)."""
        comm = self._gather_s + self._reduce_s
        if comm <= 0:
            return 0.0
        return comm + self.layers_per_stage * max(0.0, comm - self.layer_bwd_compute(chunk))

    def weights_idle_pass(self) -> float:
        """Seconds of the ascending pass a plain backward runs with nothing to compute where the
        stage's layers are sharded over the dp pipelines too and the step has fused ops: the
        executor then runs one pass for every op kind of lane 0 (the gathers of a dp group must
        match; docs/design/pipeline.md, "Stage weights"), ``L_s + 1`` gathers with no compute to
        hide them. 0 with ``dp = 1`` (a branch per op kind, none for a plain backward) or replicated
        stage weights. The paired simulation charges it."""
        if self.layout.dp == 1 or self._gather_s <= 0:
            return 0.0
        return (self.layers_per_stage + 1) * self._gather_s

    # ---- the embedding table and head split by vocabulary over sp
    @property
    def vocab_shards(self) -> int:
        """Over how many devices the executor splits the table and head by vocabulary: the stage's
        sp where it divides the vocabulary and stays in a node (``Layout.vocab_shards`` with
        ``gpus_per_node``, as the runtime's strategies build it), where it holds the rest at all
        (:attr:`holds_rest`); else 1."""
        if not self.holds_rest:
            return 1
        return self.layout.vocab_shards(self.model.vocab_size, self.coeffs.gpus_per_node)

    @property
    def splits_vocab(self) -> bool:
        return self.vocab_shards > 1

    def _sp_collective(self, nbytes: float) -> float:
        """Seconds of an all-gather or reduce-scatter over the stage's ``sp`` devices whose whole
        result is ``nbytes``: each device sends ``(sp-1)/sp`` of it over the sp group's link
        (``alltoall_link``, the same devices as the Ulysses all-to-alls)."""
        sp = self.layout.sp
        return self.coeffs.alltoall_link(sp).time((sp - 1) / sp * nbytes)

    def vocab_time(self, chunk: ChunkShape, stage: Optional[int], backward: bool) -> float:
        """Seconds of the vocabulary split's collectives in one op of ``stage`` on ``chunk``'s
        ``T`` (padded) tokens, 0 where the executor does not split (:attr:`splits_vocab`). The
        first stage's forward reduce-scatters the lookup (``[T, d]``, compute dtype) and its
        backward all-gathers the input cotangents (``[T, d]``); the last stage's forward
        all-gathers the normed outputs (``[T, d]``, compute dtype) and all-reduces the max and the
        stacked sums of the log-partition (``[T]``, ``[2, T]`` fp32), its backward reduce-scatters
        the outputs' fp32 gradient. The executor runs the cotangents' all-gather in the first
        stage's backward only (``rest.StageRest.lookup_cotangent``), as charged here."""
        if stage is None:
            return 0.0
        t = self.linear_tokens(chunk)
        key = (t, stage, backward)
        got = self._vocab.get(key)
        if got is None:
            got = self._vocab.put(key, self._vocab_time(t, stage, backward) if self.splits_vocab else 0.0)
        return got

    def _vocab_time(self, t: int, stage: int, backward: bool) -> float:
        activations = self.coeffs.bytes_per_element * self.model.d_model * t
        total = self._sp_collective(activations) if stage == 0 else 0.0
        if stage == self.layout.pp - 1:
            sums = 2 * self._sp_collective(4 * t) + 2 * self._sp_collective(8 * t)  # all-reduces: two ways
            total += (
                self._sp_collective(4 * self.model.d_model * t) if backward else self._sp_collective(activations) + sums
            )
        return total
