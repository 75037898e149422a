"""Time and memory cost model of one pipeline stage (InfiniPipe §3.1, Eq. 1-11; Hydraulis App. B).

Units everywhere: **seconds** for time, **bytes per device** for memory. A *stage* is
``num_layers / pp`` decoder layers run by one Ulysses group of ``sp`` devices; stage 0
also runs the embedding, the last stage the final norm, LM head and loss (the pipeline executor
holds all three on every stage: :attr:`CostModel.holds_rest`).

Pure Python/numpy: the planner imports this module, so it never imports JAX.
Coefficients come from the profiler (``jvarlen.profile``), from analytic hardware
figures (``jvarlen.plan.hardware``) or from an online refit (``jvarlen.plan.cost_fit``).
"""

from __future__ import annotations

import json
from typing import Optional

from jvarlen.layout import Layout
from jvarlen.plan.chunk import ChunkShape, executor_bucket, executor_bucket_below, tile_pairs
from jvarlen.plan.coefficients import (  # noqa: F401 (re-exported: the cost model's vocabulary)
    CostCoefficients,
    LayerTime,
    Link,
    ModelShape,
    ProfileMeta,
    profile_filename,
)
from jvarlen.plan.cost_collectives import CollectiveTimes
from jvarlen.plan.cost_head import HeadMemory
from jvarlen.plan.memo import BoundedMemo


class CostModel(CollectiveTimes, HeadMemory):
    """Per-stage time (s) and memory (bytes per device) of chunks for a given layout.

    ``stage`` arguments select the head/embedding extras of the first and last stage;
    ``stage=None`` means a middle stage (decoder layers only). With ``pp == 1`` the single
    stage is both first and last.
    """

    def __init__(
        self,
        model: ModelShape,
        layout: Layout,
        coeffs: CostCoefficients,
        state_devices: Optional[int] = None,
        pad_to: Optional[int] = None,
        stage_weights_sharded: bool = False,
        group: bool = False,
    ):
        """``state_devices``: the devices the fp32 master parameters and optimizer moments are sharded
        over (the canonical state of the whole run); default the layout's. A device group of a
        heterogeneous strategy runs on fewer devices than hold the state. ``pad_to``: every chunk's
        matmuls run over this many tokens (the pipeline executor pads all chunks of a step to one
        bucket, :meth:`padded`); None: each chunk's own bucket (``token_buckets``).
        ``stage_weights_sharded``: the compute copy and gradient accumulator of the stage's decoder
        layers are sharded over its sp group and the dp pipelines (ZeRO-3, the executor's
        ``stage_weights="sharded"``), so a device holds ``stage_bytes_per_param / (dp·sp)`` per
        layer parameter (:meth:`model_state_memory`). ``group``: the layout is a device group of a
        heterogeneous strategy, whose pull and push move the rest of the model (embedding, head)
        whole to and from every device (:meth:`step_overhead`, :meth:`_rest_bytes`)."""
        if model.num_layers % layout.pp:
            raise ValueError(f"{layout}: num_layers ({model.num_layers}) must be divisible by pp ({layout.pp})")
        if model.num_heads % layout.sp:
            raise ValueError(f"{layout}: num_heads ({model.num_heads}) must be divisible by sp ({layout.sp})")
        self.model = model
        self.layout = layout
        self.coeffs = coeffs
        self.state_devices = layout.num_devices if state_devices is None else int(state_devices)
        self.pad_to = pad_to
        self.stage_weights_sharded = bool(stage_weights_sharded)
        self.group = bool(group)
        if self.state_devices < layout.num_devices:
            raise ValueError(f"state_devices ({self.state_devices}) must be >= the layout's {layout.num_devices}")
        self.layers_per_stage = model.num_layers // layout.pp
        self._fwd, self._bwd = coeffs.layer_times(layout.sp)
        self._head_fwd, self._head_bwd = coeffs.head_times(layout.sp)
        self._recompute = coeffs.recompute_times(layout.sp)
        # the executor's own terms are fitted on multi-stage steps; one stage runs each chunk's forward
        # and backward as one op, priced by the whole-model calibration (CostCoefficients)
        self.executor_terms = layout.pp > 1
        scaled = pad_to is None or not self.executor_terms or coeffs.executor_bucket_scale
        self._bucket_scale = sorted(coeffs.bucket_token_scale.get(layout.sp, {}).items()) if scaled else []
        # memos of pure functions of this (immutable) model: the planner's searches simulate the
        # same chunks and buckets many times per iteration (bounded: a run plans ever new chunks)
        self._padded: dict = {}
        self._alltoall = BoundedMemo()
        self._vocab = BoundedMemo()
        self._scaled = BoundedMemo()
        self._p2p_link: dict = {}
        self._gather_s, self._reduce_s = self._weight_comm_times()
        self.op_terms = BoundedMemo()  # the simulator's per-op durations (jvarlen.plan.simulator._Durations)

    def fingerprint(self) -> str:
        """What its predictions depend on beyond the layout, as text: the model shape, the
        coefficients, the memory model's stage weights and padding (cache keys, cross-process checks)."""
        coeffs = json.dumps(self.coeffs.to_json(), sort_keys=True, default=str)
        return (
            f"{self.model.key()}|{coeffs}|sharded={self.stage_weights_sharded}|pad_to={self.pad_to}|group={self.group}"
        )

    def replace(self, **changes) -> "CostModel":
        """A new cost model with these constructor arguments changed (fresh memos)."""
        names = ("model", "layout", "coeffs", "state_devices", "pad_to", "stage_weights_sharded", "group")
        return CostModel(**{**{name: getattr(self, name) for name in names}, **changes})

    def with_layout(self, layout: Layout, state_devices: Optional[int] = None, group: bool = False) -> "CostModel":
        """This cost model for another layout (unpadded; ``state_devices``: default the layout's)."""
        return self.replace(layout=layout, state_devices=state_devices, pad_to=None, group=group)

    def with_stage_weights(self, sharded: bool) -> "CostModel":
        """This cost model with the stages' decoder layers sharded over each stage's devices, or
        replicated (``parallel.stage_weights``)."""
        return self.replace(stage_weights_sharded=sharded)

    def padded(self, bucket: Optional[int]) -> "CostModel":
        """This cost model with every chunk padded to ``bucket`` tokens (None: unpadded); one object
        per bucket, so that its memos serve every simulation padded to that bucket."""
        got = self._padded.get(bucket)
        if got is None:
            got = self._padded[bucket] = self.replace(pad_to=bucket)
        return got

    def _is_last(self, stage: Optional[int]) -> bool:
        return stage is not None and stage == self.layout.pp - 1

    # ---- time (seconds)
    def pairs(self, chunk: ChunkShape) -> float:
        """The quadratic quantity of Eq. 1: exact pairs, or visited tiles (``attention_block``)."""
        b = self.coeffs.attention_block
        return chunk.attention_pairs if b <= 0 else tile_pairs(chunk, b)

    def linear_tokens(self, chunk: ChunkShape) -> int:
        """Tokens the matmuls run over: the chunk padded to its bucket (``token_buckets``), or to the
        step's one bucket (``pad_to``)."""
        t = chunk.tokens
        if self.pad_to is not None:
            return max(int(self.pad_to), t)
        for b in sorted(self.coeffs.token_buckets):
            if b >= t:
                return b
        return t

    def time_tokens(self, chunk: ChunkShape) -> float:
        """The token count the linear term of Eq. 1 is charged on: :meth:`linear_tokens` times the
        measured per-token factor of its bucket (``bucket_token_scale``; on a multi-stage executor's
        padded chunks only where ``executor_bucket_scale``)."""
        t = self.linear_tokens(chunk)
        if not self._bucket_scale:
            return float(t)
        got = self._scaled.get(t)
        if got is None:
            factor = next((f for b, f in self._bucket_scale if b >= t), self._bucket_scale[-1][1])
            got = self._scaled.put(t, t * factor)
        return got

    def grows_with_padding(self) -> bool:
        """Whether a chunk's time never falls as the bucket it is padded to (an executor bucket,
        :meth:`padded`) or its recomputed layers grow: every Eq. 1 term (layers, head,
        recomputation) and the sp group's link non-negative, and the tokens charged
        (:meth:`time_tokens`) non-decreasing from each executor bucket to the next across every
        per-bucket factor's edge (a measured factor may fall enough to undo the extra tokens). A
        search may then bound a padded step from below by its chunks at their own buckets."""
        sp = self.layout.sp
        terms = (*self.coeffs.layer_times(sp), *self.coeffs.head_times(sp), self.coeffs.recompute_times(sp))
        if min(min(t.alpha1, t.alpha2, t.beta1) for t in terms) < 0:
            return False
        link = self.coeffs.alltoall_link(sp)
        if link.bandwidth <= 0 or link.latency < 0:
            return False
        one = ChunkShape(0, (1,))

        def charged(bucket: int) -> float:
            return self.padded(bucket).time_tokens(one)

        for edge, _ in self.padded(None)._bucket_scale[:-1]:
            below, above = executor_bucket_below(edge, sp), executor_bucket(edge + 1, sp)
            if below and charged(below) > charged(above):
                return False
        return True

    def layer_fwd_compute(self, chunk: ChunkShape) -> float:
        """Eq. 1 for one layer on the stage's sp group (no all-to-all)."""
        return self._fwd(self.pairs(chunk), self.time_tokens(chunk), self.layout.sp)

    def layer_bwd_compute(self, chunk: ChunkShape) -> float:
        return self._bwd(self.pairs(chunk), self.time_tokens(chunk), self.layout.sp)

    def layer_alltoall_time(self, chunk: ChunkShape) -> float:
        """Eq. 3 for one layer and one direction: four all-to-alls (q, k, v in; output back). Each
        device sends ``(sp-1)/sp`` of its ``tokens/sp``: e · tokens/sp · (sp-1)/sp · (2·q_dim + 2·kv_dim) bytes."""
        sp = self.layout.sp
        if sp == 1:
            return 0.0
        got = self._alltoall.get(chunk.tokens)
        if got is None:
            e = self.coeffs.bytes_per_element
            m = self.model
            per_token = [m.q_dim, m.kv_dim, m.kv_dim, m.q_dim]
            link = self.coeffs.alltoall_link(sp)
            local = chunk.tokens / sp * (sp - 1) / sp
            got = self._alltoall.put(chunk.tokens, sum(link.time(e * local * w) for w in per_token))
        return got

    def alltoall_time(self, chunk: ChunkShape) -> float:
        """Eq. 3 for the whole stage, one direction (forward; backward moves the same volume)."""
        return self.layers_per_stage * self.layer_alltoall_time(chunk)

    def fwd_compute_time(self, chunk: ChunkShape, stage: Optional[int] = None) -> float:
        t = self.layers_per_stage * self.layer_fwd_compute(chunk)
        if self._is_last(stage):
            t += self._head_fwd(0, self.time_tokens(chunk), self.layout.sp)
        return t

    def bwd_compute_time(self, chunk: ChunkShape, stage: Optional[int] = None) -> float:
        t = self.layers_per_stage * self.layer_bwd_compute(chunk)
        if self._is_last(stage):
            t += self._head_bwd(0, self.time_tokens(chunk), self.layout.sp)
        return t

    def fwd_time(self, chunk: ChunkShape, stage: Optional[int] = None) -> float:
        """Eq. 4 = Eq. 1 + Eq. 3 for the stage's layers (+ head on the last stage), plus the
        sharded stage weights' gathers that compute does not hide (:meth:`weights_fwd_exposed`)
        and the vocabulary split's collectives (:meth:`vocab_time`)."""
        comm = self.alltoall_time(chunk) + self.weights_fwd_exposed(chunk) + self.vocab_time(chunk, stage, False)
        return self.fwd_compute_time(chunk, stage) + comm

    def bwd_time(self, chunk: ChunkShape, stage: Optional[int] = None) -> float:
        """Backward of the stage without recomputation (add :meth:`recompute_time`), plus the
        sharded stage weights' gathers and reduce-scatters not hidden (:meth:`weights_bwd_exposed`)
        and the vocabulary split's collectives (:meth:`vocab_time`)."""
        comm = self.alltoall_time(chunk) + self.weights_bwd_exposed(chunk) + self.vocab_time(chunk, stage, True)
        return self.bwd_compute_time(chunk, stage) + comm

    def recompute_time(self, chunk: ChunkShape, layers: int) -> float:
        """Eq. 11: re-running the forward of ``layers`` checkpointed layers in the backward
        (measured ``coeffs.recompute`` when the profile has it, else the forward). With sharded
        stage weights a recomputed layer's forward also hides more of the next layer's gather and
        the previous layer's reduce-scatter, so it adds ``max(b + r, comm) - max(b, comm)`` per
        layer (``b``, ``r``: the layer's backward and recomputation, ``comm``:
        :meth:`weight_comm_times` summed), which keeps :meth:`bwd_time` plus this additive."""
        if not 0 <= layers <= self.layers_per_stage:
            raise ValueError(f"recompute layers must be in [0, {self.layers_per_stage}], got {layers}")
        if layers == 0:
            return 0.0
        compute = self._recompute(self.pairs(chunk), self.time_tokens(chunk), self.layout.sp)
        comm = self._gather_s + self._reduce_s
        if comm > 0:
            b = self.layer_bwd_compute(chunk)
            compute = max(b + compute, comm) - max(b, comm)
        return layers * (compute + self.layer_alltoall_time(chunk))

    def executor_recompute_time(self, chunk: ChunkShape, layers: int) -> float:
        """:meth:`recompute_time` as the lock-step pipeline executor pays it: plus
        ``tick_recompute_factor`` forwards of each recomputed layer (fitted on executor steps)."""
        t = self.recompute_time(chunk, layers)
        factor = self.coeffs.tick_recompute_factor if self.executor_terms else 0.0
        return t + layers * factor * self.layer_fwd_compute(chunk) if factor else t

    def p2p_time(self, chunk: ChunkShape, stage: int = 0) -> float:
        """Eq. 2: activations (forward) or their gradient (backward) of one chunk crossing the
        boundary between ``stage`` and ``stage + 1``: ``e · D · tokens / sp`` bytes per device,
        inter-node where the two stages' devices sit in different nodes (mesh order ``(dp, pp,
        sp)``, ``sp`` fastest, ``gpus_per_node`` devices per node)."""
        link = self._p2p_link.get(stage)
        if link is None:
            if not 0 <= stage < self.layout.pp - 1:
                raise ValueError(f"p2p boundary stage must be in [0, {self.layout.pp - 1}), got {stage}")
            sp, pp, g = self.layout.sp, self.layout.pp, self.coeffs.gpus_per_node
            firsts = [(d * pp + stage) * sp for d in range(self.layout.dp)]
            intra = all(f // g == (f + 2 * sp - 1) // g for f in firsts)  # worst replica decides
            link = self._p2p_link[stage] = self.coeffs.p2p_intra if intra else self.coeffs.p2p_inter
        return link.time(self.coeffs.bytes_per_element * self.model.d_model * chunk.tokens / self.layout.sp)

    def tick_overhead(self, context: int = 0) -> float:
        """The lock-step executor's own seconds per tick (0 unless fitted on executor steps): a
        constant, a part per token of the step's bucket (``pad_to``; none without one) and a part
        per token of its ``context`` bucket (:func:`jvarlen.plan.chunk.executor_context`); 0 on
        one stage."""
        c = self.coeffs
        if not self.executor_terms:
            return 0.0
        return c.tick_overhead + c.tick_token_overhead * (self.pad_to or 0) + c.tick_context_overhead * context

    def op_overhead(self) -> float:
        """The lock-step executor's own seconds per op beyond the chunk's compute."""
        return self.coeffs.op_overhead

    def step_overhead(self) -> float:
        """Seconds per iteration outside the pipeline: ``step_overhead`` + :meth:`sync_time`."""
        return self.coeffs.step_overhead_for(self.layout.sp) + self.sync_time()

    def sync_time(self, stage_layers: Optional[int] = None) -> float:
        """The parameter pull and gradient push of one device (``sync_bytes_per_param`` over
        ``sync_link``): the largest stage's parameters, or for a device group (``group``) its stage's
        decoder layers, ``stage_layers`` of them if given (a group's devices move the iteration's
        largest stage, jvarlen/parallel/groups.py), and the rest of the model, which the groups' pull
        hands every device. The same with sharded stage weights: a group's device receives its
        stage's layers whole and keeps its chunk (docs/design/heterogeneous.md, "Bytes and
        memory"); the pipeline strategy's sharded pull, which gathers nothing over dp and sp, would
        sync less than this charges."""
        c, m = self.coeffs, self.model
        if c.sync_bytes_per_param <= 0:
            return 0.0
        if self.group:
            layers = self.layers_per_stage if stage_layers is None else stage_layers
            params = layers * m.layer_params + m.embed_params + m.head_params
        else:
            params = max(m.stage_params(p, self.layout.pp) for p in range(self.layout.pp))
        return c.sync_link.time(c.sync_bytes_per_param * params)

    # ---- memory (bytes per device)
    def activation_memory(self, chunk: ChunkShape, ckpt_layers: int = 0, stage: Optional[int] = None) -> float:
        """Eq. 10 for one stage: bytes one device of the stage keeps for ``chunk`` from the start
        of its forward to the end of its backward.

        ``(L_s - l) · M_token · T/sp``  (Eq. 5 Act, un-checkpointed layers; ``M_token`` is
        ``m_stored_token``, what the pipeline executor's stored layer keeps under its residual
        policy, where the coefficients know it, else the profile's ``m_token``)
        ``+ (L_s - l) · m_context_token · C/sp``  (attention residual over the chunk's C context
        keys: the concatenated K/V the kernel reads; not in the paper's Eq. 5, measured here)
        ``+ (1 - I) · 2 · e_dkv · kv_dim · L_s · T/sp``  (Eq. 5 M_dkv)
        ``+ l · e · (D + (1 - I) · 2 · kv_dim) · T/sp``  (Eq. 9 M_ckpt: input, plus K/V kept for
        later slices; with MHA this is ``(3 - 2I) e D``)
        ``+`` :meth:`head_memory` on the last stage.
        """
        Ls = self.layers_per_stage
        if not 0 <= ckpt_layers <= Ls:
            raise ValueError(f"ckpt_layers must be in [0, {Ls}], got {ckpt_layers}")
        c, m = self.coeffs, self.model
        t = chunk.tokens / self.layout.sp
        not_tail = 0 if chunk.tail else 1
        stored = c.m_stored_token or c.m_token  # what the executor's stored layer keeps, where known
        act = (Ls - ckpt_layers) * (stored * t + c.m_context_token * chunk.context / self.layout.sp)
        dkv = not_tail * 2 * c.dkv_bytes_per_element * m.kv_dim * Ls * t
        ckpt = ckpt_layers * c.bytes_per_element * (m.d_model + not_tail * 2 * m.kv_dim) * t
        head = self.head_memory(chunk) if self._is_last(stage) else 0.0
        return act + dkv + ckpt + head

    def working_memory(self, chunk: ChunkShape, ckpt_layers: int = 0) -> float:
        """Transient bytes of the backward of ``chunk`` while it runs (cotangents and temporaries of
        one layer; with ``ckpt_layers > 0`` also the residuals of the layer being recomputed):
        ``m_work_token · T/sp`` (or ``m_work_remat_token · T/sp``) ``+ m_work_context_token · C/sp``.
        Only one chunk's backward runs at a time on a stage, so this is added once, not per chunk
        in flight."""
        c = self.coeffs
        per_token = c.m_work_remat_token if ckpt_layers > 0 else c.m_work_token
        return (per_token * chunk.tokens + c.m_work_context_token * chunk.context) / self.layout.sp

    @property
    def executor_per_layer(self) -> bool:
        """Whether the pipeline executor's backward adds each layer's gradients into the
        accumulator as it descends (``StageProgram.per_layer``): a step compiled off XLA:CPU (the
        profile's backend: a GPU or TPU profile, or hardware figures), its stage weights whole on
        each device (sharded over more than one device, the ops return their reduce-scattered
        gradients stacked). Coefficients that name no backend are charged the stacks, the larger."""
        sharded = self.stage_weights_sharded and self.layout.dp * self.layout.sp > 1
        return self.coeffs.meta.backend in ("gpu", "tpu", "analytic") and not sharded

    def layer_gradient_memory(self) -> float:
        """Bytes one device of a stage holds beside :meth:`working_memory` while the pipeline
        executor runs a backward: its layers' gradients in the compute dtype, one layer's
        ``e · layer params`` where it adds each into the accumulator as it descends
        (:attr:`executor_per_layer`), else stacked, ``e · L_s · layer params`` (with sharded stage
        weights the reduce-scattered ``1/(dp·sp)`` of them, summed in the accumulator's dtype),
        added after the op. Where every device holds the rest of the model (:attr:`holds_rest`),
        one op's gradient of the rest is charged too, in the rest's dtypes (:meth:`_rest_bytes`):
        one program runs on every stage, so a middle stage allocates the head's gradient as the
        last one does. A fused data-parallel step (:meth:`peak_memory`) has no such copy."""
        c = self.coeffs
        n = self.layers_per_stage * self.model.layer_params
        group = self.layout.dp * self.layout.sp
        rest = self._rest_bytes()[1] if self.holds_rest else 0.0
        if self.stage_weights_sharded and group > 1:
            return (c.stage_bytes_per_param - c.bytes_per_element) * n / group + rest
        if self.executor_per_layer:
            return c.bytes_per_element * self.model.layer_params + rest
        return c.bytes_per_element * n + rest

    def memory_floor(self, stage: int) -> float:
        """Bytes a device of ``stage`` needs before any token: :meth:`model_state_memory` and the
        layer gradients one backward returns (:meth:`layer_gradient_memory`). Capacities are the
        budget minus this, divided by what each token adds."""
        return self.model_state_memory(stage) + self.layer_gradient_memory()

    def backward_memory(self, chunk: ChunkShape, ckpt_layers: int = 0) -> float:
        """Transient bytes of ``chunk``'s backward as the pipeline executor runs it:
        :meth:`working_memory` + :meth:`layer_gradient_memory`."""
        return self.working_memory(chunk, ckpt_layers) + self.layer_gradient_memory()

    def peak_memory(self, chunk: ChunkShape, ckpt_layers: int = 0, stage: Optional[int] = None) -> float:
        """Peak activation bytes of one device while ``chunk``'s backward runs with no other chunk in
        flight: Eq. 10 (:meth:`activation_memory`) plus :meth:`working_memory`. This is what XLA's
        ``memory_analysis().temp_size_in_bytes`` of a forward+backward program measures
        (``scripts/validate_cost_memory.py``)."""
        return self.activation_memory(chunk, ckpt_layers, stage) + self.working_memory(chunk, ckpt_layers)

    def model_state_memory(self, stage: int) -> float:
        """Model states on one device of ``stage`` (Hydraulis B.1 (b)): fp32 master params and
        Adam moments fully sharded over all devices, plus the stage's compute copy and gradient
        accumulator, plus a constant workspace. With the stage's decoder layers sharded over its
        ``dp × sp`` devices (and more than one of them), their copy and accumulator are
        ``1/(dp·sp)`` per device, plus the layers in flight: two whole layers in the compute
        dtype (the one in use, the one gathered ahead), the previous layer's gradient in the
        compute dtype (reduce-scattered one layer late, over this layer's compute) and one
        layer's gradient in the accumulator's dtype, as it is reduce-scattered
        (docs/design/pipeline.md, "Stage weights"); with one layer per stage, nothing ahead and
        nothing late: the layer and its gradient in the compute dtype (docs/benchmarks.md, "One
        layer per stage, sharded"); replicated, the one layer the executor's pass
        slices out of the stacked stage (compute dtype; none with one layer, whose loop XLA
        removes). Where the executor runs the layout
        (:attr:`holds_rest`), every device holds the embedding and head with their accumulators,
        whatever its stage, in their pulled dtypes (:meth:`_rest_bytes`; docs/design/heterogeneous.md,
        "Bytes and memory"); a fused data-parallel step (``pp == 1``) holds them at
        ``stage_bytes_per_param``. Plus :meth:`accumulator_relayout_memory` for a group on a GPU."""
        if not 0 <= stage < self.layout.pp:
            raise ValueError(f"stage must be in [0, {self.layout.pp}), got {stage}")
        c, m = self.coeffs, self.model
        sharded = c.master_bytes_per_param * m.param_count / self.state_devices
        if self.holds_rest:
            params, rest = self.layers_per_stage * m.layer_params, self._rest_bytes()[0]
        else:
            params, rest = m.stage_params(stage, self.layout.pp), 0.0
        in_flight, group = 0.0, self.layout.dp * self.layout.sp
        if self.stage_weights_sharded and group > 1:  # the decoder layers (the rest: _rest_bytes)
            layers = m.num_layers // self.layout.pp * m.layer_params
            params += layers / group - layers
            # three layers of e bytes + one gradient of (stage_bytes_per_param - e) bytes per
            # parameter; one layer per stage: the layer and its gradient, e bytes each
            ahead = c.stage_bytes_per_param if self.layers_per_stage > 1 else 0.0
            in_flight = (2 * c.bytes_per_element + ahead) * m.layer_params
        elif self.holds_rest and self.layers_per_stage > 1:
            in_flight = c.bytes_per_element * m.layer_params
        if self.executor_per_layer and self.group:
            in_flight += self.accumulator_relayout_memory()
        local = c.stage_bytes_per_param * params + rest
        return sharded + local + in_flight + c.workspace_bytes

    def accumulator_relayout_memory(self) -> float:
        """Bytes a group's GPU step holds beside the accumulators it returns where the executor adds
        each layer's gradients as it descends (:attr:`executor_per_layer`): XLA carries two attention
        accumulators in the layout the weight-gradient matmuls produce and transposes them into the
        row-major outputs at the end, two more stacks of the largest projections (``wq``, ``wo``:
        ``d·H·D``) in the accumulator's dtype. LLaMA-7B, deviceless H100: 134.2 MB per layer at 8-32
        layers per stage (docs/benchmarks.md); a pipeline step, which applies its update, has none."""
        c, m = self.coeffs, self.model
        accumulator = max(c.stage_bytes_per_param - c.bytes_per_element, 0.0)  # none: state charged elsewhere
        return 2.0 * self.layers_per_stage * m.d_model * m.num_heads * m.head_dim * accumulator

    @property
    def holds_rest(self) -> bool:
        """Whether every device holds the embedding, final norm and head, whatever its stage: the
        pipeline executor (``pp > 1``, and every device group) runs one program on every stage of
        a layout and hands each device the rest of the model (:meth:`_rest_bytes`), so a middle
        stage allocates what the end stages use."""
        return self.group or self.layout.pp > 1

    def _rest_bytes(self) -> tuple[float, float]:
        """(bytes per device of the rest between ops: its copy and its gradient accumulator; bytes
        of one op's gradient of the rest), as the executor holds them (:attr:`holds_rest`). The
        embedding table (and a head tied to it) and the final norm are pulled in the parameters'
        dtype, an untied head in the compute dtype (``sharding.pulled_dtypes``); the accumulator
        is fp32 at least and shares the parameters' dtype (``stage_bytes_per_param -
        bytes_per_element`` per parameter; none where the coefficients charge no stage state), and
        an op's gradient is in the copy's dtype (the embedding's too, although it is added in
        place). The executor splits the table and an untied head by vocabulary over sp
        (:attr:`vocab_shards`), a group's too (each device keeps its rows of the pulled copy before
        the group's program runs). Measured on compiled programs: docs/benchmarks.md, "The
        embedding and head on every pipeline device"."""
        c, m = self.coeffs, self.model
        acc = max(c.stage_bytes_per_param - c.bytes_per_element, 0.0)

        def held(n: int) -> tuple[float, float]:  # (copy, accumulator) with the vocabulary split n ways
            table, head = m.embed_params / n, (m.head_params - m.d_model) / n
            return acc * (table + m.d_model) + c.bytes_per_element * head, acc * (table + m.d_model + head)

        copy, accumulator = held(self.vocab_shards)
        return copy + accumulator, copy

    @property
    def memory_budget(self) -> float:
        return self.coeffs.memory_budget

    def max_tokens(self, stage: Optional[int] = None, in_flight: int = 1, tail: bool = False) -> int:
        """Hydraulis MaxLen: the largest chunk (tokens) that fits ``in_flight`` times on ``stage``
        (all stages when None) with full recomputation (``ckpt_layers = L_s``), Eq. 8 + 10, plus the
        transients of one of them in its backward (:meth:`backward_memory`, no context), by the
        affine bounds of :meth:`chunk_memory_lines`.

        ``tail=False`` charges the K/V and dK/dV terms of a non-tail slice (the worst case).
        Returns 0 when even the model states and one backward's layer gradients do not fit.
        """
        stages = range(self.layout.pp) if stage is None else [stage]
        best = None
        for p in stages:
            lines = self.chunk_memory_lines(p, self.layers_per_stage, in_flight, tail)
            n = self.fitting_tokens(self.memory_budget - self.memory_floor(p), lines)
            best = n if best is None else min(best, n)
        return best
