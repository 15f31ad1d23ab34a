"""A generic sparse mixture-of-experts block (DeepSeek-V2/V3, Qwen2-MoE, Qwen3-Next style), in flax.

``SparseMoE(config, dtype)`` maps ``x: [T, hidden]`` to ``[T, hidden]``:

1. Router: ``logits = x @ gate.weight.T`` in float32 (``gate.weight: [num_experts, hidden]``), then
   scores ``softmax(logits)`` (``scoring="softmax"``) or ``sigmoid(logits)`` (``"sigmoid"``).
2. Top-k (``topk_method``):

   * ``"greedy"``: the ``top_k`` highest scores (Qwen2-MoE, Qwen3-Next, DeepSeek-V2-Lite).
   * ``"group_limited_greedy"`` (DeepSeek-V2): experts in ``n_group`` equal groups; a group's score
     is its best expert's; only the ``topk_group`` best groups compete (others' scores become 0).
   * ``"noaux_tc"`` (DeepSeek-V3): choice scores are ``scores + gate.e_score_correction_bias``; a
     group's score is the sum of its two best choice scores; experts outside the ``topk_group``
     best groups are excluded; the ``top_k`` best choice scores pick the experts, and their
     weights are the *uncorrected* scores.

   Then, if ``norm_topk_prob``, the weights are divided by their sum (``+ 1e-20`` for
   ``noaux_tc``, as DeepSeek-V3 does), and multiplied by ``routed_scaling_factor``.
3. Experts: SwiGLU MLPs ``down(silu(gate(x)) * up(x))`` of ``moe_intermediate_size``, combined
   with the routing weights (0 for experts not chosen): ``sum_e w[t, e] * down_e(h_e[t])``.
4. Shared experts (``shared_intermediate_size > 0``): one SwiGLU MLP of that size, always added
   (DeepSeek's ``shared_experts``, whose size is ``n_shared_experts * moe_intermediate_size``), or
   gated by ``sigmoid(shared_expert_gate(x))`` (``shared_expert_gated``: Qwen2-MoE, Qwen3-Next's
   ``shared_expert``).

Weights are in the layout transformers 5 ``save_pretrained`` writes (per-expert tensors; checked
for DeepseekV2 with 5.24): ``gate.weight`` ``[E, H]``, ``gate.e_score_correction_bias`` ``[E]``
(``noaux_tc``), ``experts.{e}.gate_proj.weight`` / ``up_proj`` ``[I, H]``, ``experts.{e}.down_proj.weight``
``[H, I]``, ``{shared_name}.gate_proj|up_proj|down_proj.weight``, ``shared_expert_gate.weight`` ``[1, H]``.
(Flax names ``experts_{e}``; ``kvjax.serve.checkpoint`` maps them to ``experts.{e}``.)

Order of operations (what makes tensor parallelism need one all-reduce): the routing weight is
linear in the down projection, so it is folded into the hidden activations *before* it:
``h[t, e, i] = silu(x @ gate_e.T) * (x @ up_e.T)`` (in the weights' dtype), then
``h'[t, e, i] = h[t, e, i] * w[t, e]`` (the product in float32, rounded once to the activations'
dtype for the matmul), then ``y[t, :] = sum_{e, i} h'[t, e, i] * down[e, :, i]``: one contraction over
experts and the intermediate dimension together, accumulated in float32 inside the dot and rounded
once to the activations' dtype (a float32 model: float32 throughout). With the experts split Megatron
style over ``"tp"`` (``kvjax.serve.param_sharding``: ``gate_proj``/``up_proj`` by rows, ``down_proj``
by columns, each rank a slice of every expert's ``moe_intermediate_size``), ``h'`` is sharded over
``i`` and this contraction ends in one partial sum ``[T, H]`` per rank; the shared experts' (split
the same way) and the routed experts' partial sums are added before the sum over ranks, so the
block costs one all-reduce of ``[T, H]``, as a dense MLP does, not one of every expert's output
``[T, E, H]``. For that sum to be one contraction (one dot, which XLA's partitioner ends in one
all-reduce; two dots added end in two), a shared expert whose size is ``k`` times the routed
experts' ``I`` (DeepSeek's ``n_shared_experts * moe_intermediate_size``, Qwen3-Next's) joins the
contraction as ``k`` more experts of weight 1 (a gated shared expert: its gate
``sigmoid(x @ gate.T)``, folded in like a routing weight), its ``k * I`` units laid ``I``-major
(``with_shared_as_experts``: a contiguous split of them over ranks that divide ``I`` is each rank's
slice of the routed experts' ``I``). A shared size the routed size does not divide keeps its own
down projection (its gate folded in before it) and partial sum, added after (two all-reduces
under tensor parallelism where XLA does not reassociate them).

Compute choice: every token runs through every expert (dense: one batched matmul over the
stacked expert weights, ``O(T * E * I * H)``) and the routing weights zero the unchosen ones. It is
exact, has static shapes and no gather/scatter, and is the fastest on CPU at the tiny sizes kvjax
serves for its tests; it wastes ``E / top_k`` times the work of a sparse dispatch, so a real-size
model wants a grouped-matmul (megablox-style) dispatch instead, which this module does not have.
The per-expert weights (the checkpoint's layout) are stacked into ``[E, I, H]`` / ``[E, H, I]`` per
call: under ``jax.jit`` that is a copy of the block's experts per step (of each rank's slice under
tensor parallelism: ``1 / tp`` of the experts), live while the block runs.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

WEIGHT_INIT_STDDEV = 0.02

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORINGS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Hyperparameters of one sparse-MoE block (frozen and hashable: part of a model's static config)."""

    hidden_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    scoring: str = "softmax"
    topk_method: str = "greedy"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_intermediate_size: int = 0
    shared_expert_gated: bool = False
    shared_name: str = "shared_experts"

    def __post_init__(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r}; expected one of {TOPK_METHODS}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring={self.scoring!r}; expected one of {SCORINGS}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        grouped = self.topk_method != "greedy"
        if grouped and (self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group):
            raise ValueError(
                f"n_group={self.n_group} must divide num_experts={self.num_experts} and "
                f"topk_group={self.topk_group} be in [1, n_group]"
            )


def route(
    config: MoEConfig, logits: jax.Array, correction_bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """``logits: [T, E]`` (float32) -> ``(weights [T, top_k] float32, expert ids [T, top_k] int32)``
    (see the module docstring for each method)."""
    c = config
    scores = jax.nn.softmax(logits, axis=-1) if c.scoring == "softmax" else jax.nn.sigmoid(logits)
    tokens = scores.shape[0]
    per_group = c.num_experts // c.n_group
    if c.topk_method == "greedy":
        weights, ids = jax.lax.top_k(scores, c.top_k)
    elif c.topk_method == "group_limited_greedy":
        group_scores = scores.reshape(tokens, c.n_group, per_group).max(axis=-1)
        keep = _group_mask(group_scores, c.topk_group, per_group)
        weights, ids = jax.lax.top_k(jnp.where(keep, scores, 0.0), c.top_k)
    else:  # noaux_tc
        bias = jnp.zeros((c.num_experts,), jnp.float32) if correction_bias is None else correction_bias
        choice = scores + bias.astype(jnp.float32)
        group_scores = jax.lax.top_k(choice.reshape(tokens, c.n_group, per_group), 2)[0].sum(axis=-1)
        keep = _group_mask(group_scores, c.topk_group, per_group)
        _, ids = jax.lax.top_k(jnp.where(keep, choice, -jnp.inf), c.top_k)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
    if c.norm_topk_prob:
        eps = 1e-20 if c.topk_method == "noaux_tc" else 0.0
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + eps)
    return weights * c.routed_scaling_factor, ids.astype(jnp.int32)


def _group_mask(group_scores: jax.Array, topk_group: int, per_group: int) -> jax.Array:
    """bool ``[T, E]``: the experts of each token's ``topk_group`` best groups."""
    _, best = jax.lax.top_k(group_scores, topk_group)
    groups = jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(group_scores.shape[0])[:, None], best].set(True)
    return jnp.repeat(groups, per_group, axis=-1)


def dense_combine_weights(weights: jax.Array, ids: jax.Array, num_experts: int) -> jax.Array:
    """Routing ``(weights [T, top_k] float32, ids [T, top_k])`` as dense combine weights
    ``[T, num_experts]`` float32: each chosen expert's weight, 0 for the others (the dense dispatch
    of the module docstring runs every expert and lets these zero the unchosen ones)."""
    dense = jnp.zeros((weights.shape[0], num_experts), jnp.float32)
    return dense.at[jnp.arange(weights.shape[0])[:, None], ids].add(weights)


def combine_experts(expert_out: jax.Array, dense: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Every expert's output on every token ``[T, E, H]`` summed with the dense combine weights
    ``[T, E]`` in float32, then cast to ``dtype``: ``[T, H]``."""
    return jnp.einsum("teh,te->th", expert_out.astype(jnp.float32), dense).astype(dtype)


def routed_down(hidden: jax.Array, dense: jax.Array, down: jax.Array) -> jax.Array:
    """The routed experts' down projections combined with the routing weights, in one contraction
    (module docstring, order of operations): ``hidden [T, E, I]`` (every expert's SwiGLU
    activations), ``dense [T, E]`` float32 combine weights (``dense_combine_weights``),
    ``down [E, H, I]`` (stacked ``down_proj`` weights) -> ``sum_{e, i} (hidden * dense)[t, e, i] *
    down[e, h, i]``: ``[T, H]`` in the activations' dtype (the product ``hidden * dense`` taken in
    float32 and rounded once to it), accumulated in float32 in the dot. With ``I`` split over
    tensor-parallel ranks the result is one ``[T, H]`` partial sum per rank."""
    weighted = (hidden.astype(jnp.float32) * dense[:, :, None]).astype(hidden.dtype)
    return jnp.einsum("tei,ehi->th", weighted, down)  # a bfloat16 dot accumulates in float32


def with_shared_as_experts(
    hidden: jax.Array,
    dense: jax.Array,
    down: jax.Array,
    shared: jax.Array,
    weight: jax.Array,
    shared_down: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The shared expert appended to the routed ones as ``k = I_shared / I`` more experts of the
    routed experts' intermediate size ``I``, so that ``routed_down`` contracts both at once
    (module docstring): ``hidden [T, E, I]``, ``dense [T, E]``, ``down [E, H, I]`` plus the shared
    expert's activations ``shared [T, k * I]``, its per-token weight ``weight [T, 1]`` float32 (1,
    or its sigmoid gate) and ``shared_down [H, k * I]`` -> ``[T, E + k, I]``, ``[T, E + k]``,
    ``[E + k, H, I]``. Shared unit ``j`` goes to ``[j // k, j % k]`` (``I``-major), so a
    contiguous split of ``k * I`` over ranks that divide ``I`` is a split of ``I``: each rank's
    slice of the shared expert lands on its slice of the routed experts, and nothing moves."""
    tokens, inter = hidden.shape[0], hidden.shape[2]
    k = shared.shape[1] // inter
    shared_hidden = shared.reshape(tokens, inter, k).transpose(0, 2, 1)  # [T, k, I]
    shared_down = shared_down.reshape(shared_down.shape[0], inter, k).transpose(2, 0, 1)  # [k, H, I]
    return (
        jnp.concatenate([hidden, shared_hidden.astype(hidden.dtype)], axis=1),
        jnp.concatenate([dense, jnp.broadcast_to(weight, (tokens, k))], axis=1),
        jnp.concatenate([down, shared_down.astype(down.dtype)], axis=0),
    )


class Weight(nn.Module):
    """A named parameter ``weight`` of ``shape`` (Hugging Face's ``nn.Linear.weight`` layout)."""

    shape: tuple[int, ...]
    dtype: jnp.dtype
    init_stddev: float = WEIGHT_INIT_STDDEV

    @nn.compact
    def __call__(self) -> jax.Array:
        return self.param("weight", nn.initializers.normal(self.init_stddev), self.shape, self.dtype)


class _SwiGLUWeights(nn.Module):
    """``gate_proj``/``up_proj`` ``[I, H]`` and ``down_proj`` ``[H, I]`` of one expert."""

    hidden: int
    intermediate: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        h, i, dt = self.hidden, self.intermediate, self.dtype
        return (
            Weight((i, h), dt, name="gate_proj")(),
            Weight((i, h), dt, name="up_proj")(),
            Weight((h, i), dt, name="down_proj")(),
        )


class _Router(nn.Module):
    """``weight [E, H]`` and, for ``noaux_tc``, ``e_score_correction_bias [E]`` (float32 buffers)."""

    config: MoEConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        weight = self.param(
            "weight", nn.initializers.normal(WEIGHT_INIT_STDDEV), (c.num_experts, c.hidden_size), self.dtype
        )
        bias = None
        if c.topk_method == "noaux_tc":
            bias = self.param("e_score_correction_bias", nn.initializers.zeros, (c.num_experts,), jnp.float32)
        logits = x.astype(jnp.float32) @ weight.astype(jnp.float32).T
        return route(c, logits, bias)


class SparseMoE(nn.Module):
    """The sparse-MoE block (module docstring). ``x: [T, hidden]`` -> ``[T, hidden]`` in x's dtype."""

    config: MoEConfig
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        weights, ids = _Router(c, self.dtype, name="gate")(x)
        dense = dense_combine_weights(weights, ids, c.num_experts)
        experts = [
            _SwiGLUWeights(c.hidden_size, c.moe_intermediate_size, self.dtype, name=f"experts_{e}")()
            for e in range(c.num_experts)
        ]
        gate = jnp.stack([w[0] for w in experts])  # [E, I, H]
        up = jnp.stack([w[1] for w in experts])
        down = jnp.stack([w[2] for w in experts])  # [E, H, I]
        hidden = jax.nn.silu(jnp.einsum("th,eih->tei", x, gate)) * jnp.einsum("th,eih->tei", x, up)
        shared_down = None
        if c.shared_intermediate_size:
            gate_proj, up_proj, shared_down = _SwiGLUWeights(
                c.hidden_size, c.shared_intermediate_size, self.dtype, name=c.shared_name
            )()
            shared = jax.nn.silu(x @ gate_proj.T) * (x @ up_proj.T)  # [T, I_shared]
            weight = jnp.ones((x.shape[0], 1), jnp.float32)
            if c.shared_expert_gated:
                gate_weight = Weight((1, c.hidden_size), self.dtype, name="shared_expert_gate")()
                weight = jax.nn.sigmoid((x @ gate_weight.T).astype(jnp.float32))
            if c.shared_intermediate_size % c.moe_intermediate_size == 0:  # as more experts (docstring)
                hidden, dense, down = with_shared_as_experts(hidden, dense, down, shared, weight, shared_down)
                shared_down = None
            else:
                shared = (shared.astype(jnp.float32) * weight).astype(shared.dtype)
        y = routed_down(hidden, dense, down)  # every expert on every token (documented)
        if shared_down is not None:  # a size the experts' does not divide: its own partial sum
            y = y + shared @ shared_down.T
        return y.astype(x.dtype)
