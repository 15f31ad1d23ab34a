"""DeepSeek-V3's serving composition compiled for a 16-chip TPU slice without a TPU: its parts,
their collectives against the minimum, and their per-chip bytes against the chip's HBM.

The composition (SGLang's DeepSeek-V3 deployment): DP attention over TP, with the model's MTP
(NextN) layer drafting EAGLE-style, and the host tier. Its device programs, compiled here for the
chips of one topology (``v5p:2x2x4`` or ``v6e:4x4``, 16 chips):

* ``"dp_step"``: the DP-attention decode step (``kvjax.dp.step.make_dp_step``) at dp 2 x tp 8
  (``kvjax.serve.abstract_dp_step``): each rank decodes ``SEQS`` sequences of ``CONTEXT`` tokens;
* ``"dp_eagle_round"``: the composed step, one MTP speculative round of every DP rank in one
  program (``kvjax.dp.speculative.make_dp_round_step``, ``NUM_STEPS`` draft tokens) at dp 2 x
  tp 8 (``kvjax.serve.abstract_dp_round``): the round each decode step of the composition runs,
  with overlap scheduling (each rank's round continued on the device from the round before it,
  ``chained``);
* ``"eagle_round"``: the same round without DP attention, at tp 16 over the whole slice
  (``make_eagle_round_step``, ``kvjax.serve.abstract_eagle_round``), for comparison.

The host tier adds no collective and no bytes to these programs: its pools live in host memory
and its page copies are programs of their own (``tests/tpu/test_host_transfer_tpu.py``).

The model: DeepSeek-V3's layer sizes (hidden 7168, MLA with a 512 + 64 latent, 128 heads, 256
routed experts of 2048 and one shared, top-8, its ``noaux_tc`` sigmoid router) cut to
``LAYERS`` decoder layers with ``first_k_dense_replace = 1`` (layer 0 dense, layer 1 MoE; the
MTP layer is MoE too) and a 4096-token vocabulary, so a compile takes seconds; its YaRN RoPE and
fp8 weights are not built (neither changes a layer's shapes or collectives). Weights are
shapes only.

The minimum (Megatron over each part's TP group, ``kvjax.serve.compiled_step``): one all-reduce
of ``[tokens, hidden]`` bf16 after attention and one after the MLP per layer whose output is used:

* DP step: per layer over the rank's 8 chips, ``tokens`` = one rank's (the MLP runs per rank
  over its attention TP group, ``kvjax.dp.step``: no gather of the ranks' tokens before the MoE
  and no scatter after, as SGLang's DP attention does over all 16 chips); outside the layers,
  when the slice spans several hosts, the sampled tokens of every rank to every host (``dp x
  S`` int32 over ``"data"``, ``kvjax.dp.rank_mesh.host_sharding``), nothing on one host.
* EAGLE round, over each TP group (a rank's 8 chips under DP, the 16 chips at tp 16): the
  target's verify forward, per layer, ``tokens`` = the verify bucket (one rank's ``S x (k + 1)``
  rounded up); the MTP layer's ``k`` chained decode steps (a loop), ``tokens`` = the draft bucket,
  per step; the draft's pass over the verified tokens after verification none (only its KV write
  is live, and the latent projection is replicated). Outside the layers nothing at tp 16
  (embedding and LM head replicated); under DP on several hosts every rank's proposals ``[dp, S,
  k]`` and greedy tokens ``[dp, S, k + 1]`` int32 to every host.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from kvjax.config import CacheConfig
from kvjax.serve.abstract_dp_round import abstract_dp_round_inputs, lower_dp_round
from kvjax.serve.abstract_dp_step import abstract_dp_step_inputs, dp_topology_mesh, lower_dp_step
from kvjax.serve.abstract_eagle_round import abstract_eagle_round_inputs, lower_eagle_round
from kvjax.serve.abstract_step import DecodeBatch, bytes_per_device, sized_like, topology_mesh
from kvjax.serve.compiled_step import Collective, collectives
from kvjax.serve.model import as_model_config
from kvjax.spec import ModelSpec

__all__ = [
    "CHIPS",
    "CONTEXT",
    "DP",
    "HBM_BYTES",
    "KINDS",
    "LAYERS",
    "NUM_STEPS",
    "PARTS",
    "SEQS",
    "TOPOLOGIES",
    "CompiledPart",
    "collective_bytes",
    "compile_part",
    "composed_spec",
    "full_model_weight_bytes",
]

TOPOLOGIES = ("v5p:2x2x4", "v6e:4x4")
"""16-chip slices ``jax.experimental.topologies`` describes with the installed libtpu."""
HBM_BYTES = {"v5p": 95 << 30, "v6e": 32 << 30}
"""HBM per chip, by TPU generation (the topology name's prefix)."""
CHIPS = 16
DP = 2
LAYERS = 2
NUM_STEPS = 3
SEQS = 32
CONTEXT = 2048
POOL_TOKENS = 1 << 16
PAGE_SIZE = 64
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
PARTS = ("dp_step", "dp_eagle_round", "eagle_round")
MTP = "mtp"
"""The name the MTP layer's collectives are accounted under (their op names carry ``NextNDraft``)."""


def composed_spec(num_layers: int = LAYERS) -> ModelSpec:
    """DeepSeek-V3's layer sizes, ``num_layers`` layers of which the first is dense (module docstring)."""
    return sized_like(
        "deepseek-v3",
        num_layers=num_layers,
        vocab_size=4096,
        first_k_dense_replace=1,
        rope_scaling=None,
        quantization_config=None,
    )


@dataclasses.dataclass(frozen=True)
class CompiledPart:
    """One part of the composition compiled for ``topology``.

    Attributes:
        name: ``"dp_step"`` or ``"eagle_round"``.
        topology: the slice.
        spec: the model.
        text: the compiled program's text (one chip's).
        memory: its ``memory_analysis()``.
        weight_bytes: the weights one chip holds (target and draft).
        pool_bytes: the device pools one chip holds (the hidden-state store of the round included).
        input_bytes: the step's other arguments on one chip (tokens, metadata).
        minimum: bytes per execution the minimum moves (module docstring), by where: a layer
            index, ``"mtp"``, or ``"outside"``; each ``{kind: bytes}``.
        group_size: chips in each TP group of the part's layer collectives.
        donated: the names (prefixes) of the entry parameters updated in place: the pools, and
            the round's hidden-state store (``"store"``; ``"args[0]"`` in the DP round, whose
            program takes it positionally).
        seconds: the compile's wall time (lowering included).
    """

    name: str
    topology: str
    spec: ModelSpec
    text: str
    memory: Any
    weight_bytes: int
    pool_bytes: int
    input_bytes: int
    minimum: dict[str, dict[str, int]]
    group_size: int
    donated: tuple[str, ...]
    seconds: float

    @property
    def hbm_bytes(self) -> int:
        """The chip's HBM (:data:`HBM_BYTES`)."""
        return HBM_BYTES[self.topology.split(":")[0]]

    @property
    def found(self) -> list[Collective]:
        return collectives(self.text)


def _activation(tokens: int, hidden: int, dtype: str) -> int:
    return tokens * hidden * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Built:
    """A part's compiled program, its minimum, its TP group size, its donated parameter names and
    its per-chip ``(weights, pools, other arguments)`` bytes."""

    compiled: Any
    minimum: dict[str, dict[str, int]]
    group_size: int
    donated: tuple[str, ...]
    sizes: tuple[int, int, int]


def _dp_part(topology: str) -> Built:
    spec = composed_spec()
    config = CacheConfig(
        tp_size=CHIPS,
        dp_size=DP,
        enable_dp_attention=True,
        page_size=PAGE_SIZE,
        max_total_tokens=POOL_TOKENS,
        context_length=CONTEXT,
    )
    mesh = dp_topology_mesh(topology, DP, CHIPS // DP)
    inputs = abstract_dp_step_inputs(spec, config, mesh, DecodeBatch(seqs=SEQS, context=CONTEXT))
    compiled = lower_dp_step(spec, inputs).compile()
    model = as_model_config(spec)
    per_layer = _activation(inputs.tokens.shape[1], model.hidden_size, model.dtype)
    minimum: dict[str, dict[str, int]] = {str(n): {"all-reduce": 2 * per_layer} for n in range(LAYERS)}
    gathered = inputs.tokens.sharding.is_fully_replicated  # several hosts: every rank's tokens everywhere
    minimum["outside"] = {"all-gather": DP * SEQS * 4} if gathered else {}
    sizes = (
        bytes_per_device(inputs.params),
        bytes_per_device(inputs.pools),
        bytes_per_device((inputs.tokens, inputs.meta)),
    )
    return Built(compiled, minimum, CHIPS // DP, ("pools",), sizes)


def _round_config() -> CacheConfig:
    return CacheConfig(
        tp_size=CHIPS,
        page_size=PAGE_SIZE,
        max_total_tokens=POOL_TOKENS,
        context_length=CONTEXT,
        speculative_algorithm="NEXTN",
        speculative_num_steps=NUM_STEPS,
        speculative_num_draft_tokens=NUM_STEPS + 1,
    )


def _round_part(topology: str) -> Built:
    spec = composed_spec()
    config = _round_config()
    mesh = topology_mesh(topology)
    inputs = abstract_eagle_round_inputs(spec, config, mesh, DecodeBatch(seqs=SEQS, context=CONTEXT), NUM_STEPS)
    compiled = lower_eagle_round(spec, mesh, inputs).compile()
    model = as_model_config(spec)
    verify = _activation(inputs.verify_meta.positions.shape[0], model.hidden_size, model.dtype)
    draft = _activation(inputs.draft_metas.positions.shape[1], model.hidden_size, model.dtype)
    minimum: dict[str, dict[str, int]] = {str(n): {"all-reduce": 2 * verify} for n in range(LAYERS)}
    minimum[MTP] = {"all-reduce": NUM_STEPS * 2 * draft}
    minimum["outside"] = {}
    weights = bytes_per_device((inputs.params, inputs.draft_params))
    pools = bytes_per_device((inputs.pools, inputs.store))
    rest = bytes_per_device((inputs.first_tokens, inputs.draft_metas, inputs.verify_meta))
    return Built(compiled, minimum, CHIPS, ("pools", "store"), (weights, pools, rest))


def _dp_round_part(topology: str) -> Built:
    spec = composed_spec()
    config = _round_config().replace(dp_size=DP, enable_dp_attention=True)
    mesh = dp_topology_mesh(topology, DP, CHIPS // DP)
    inputs = abstract_dp_round_inputs(spec, config, mesh, DecodeBatch(seqs=SEQS, context=CONTEXT), NUM_STEPS)
    compiled = lower_dp_round(spec, inputs, chained=True).compile()  # overlap scheduling, the composition's
    model = as_model_config(spec)
    verify = _activation(inputs.verify_meta.positions.shape[1], model.hidden_size, model.dtype)
    draft = _activation(inputs.draft_metas.positions.shape[2], model.hidden_size, model.dtype)
    minimum: dict[str, dict[str, int]] = {str(n): {"all-reduce": 2 * verify} for n in range(LAYERS)}
    minimum[MTP] = {"all-reduce": NUM_STEPS * 2 * draft}
    gathered = inputs.first_tokens.sharding.is_fully_replicated  # several hosts: every rank's outputs everywhere
    outputs = DP * SEQS * (2 * NUM_STEPS + 1) * 4  # proposals [dp, S, k] and greedy [dp, S, k + 1], int32
    minimum["outside"] = {"all-gather": outputs} if gathered else {}
    weights = bytes_per_device((inputs.params, inputs.draft_params))
    pools = bytes_per_device((inputs.pools, inputs.store))
    rest = bytes_per_device((inputs.first_tokens, inputs.draft_metas, inputs.verify_meta))
    return Built(compiled, minimum, CHIPS // DP, ("pools", "args[0]"), (weights, pools, rest))


_BUILDERS: dict[str, Callable[[str], Built]] = {
    "dp_step": _dp_part,
    "dp_eagle_round": _dp_round_part,
    "eagle_round": _round_part,
}


def compile_part(name: str, topology: str) -> CompiledPart:
    """Part ``name`` (:data:`PARTS`) of the composition compiled for ``topology`` (module
    docstring); ``KeyError`` for another name."""
    import time

    start = time.perf_counter()
    built = _BUILDERS[name](topology)
    seconds = time.perf_counter() - start
    weights, pools, rest = built.sizes
    return CompiledPart(
        name=name,
        topology=topology,
        spec=composed_spec(),
        text=built.compiled.as_text(),
        memory=built.compiled.memory_analysis(),
        weight_bytes=weights,
        pool_bytes=pools,
        input_bytes=rest,
        minimum=built.minimum,
        group_size=built.group_size,
        donated=built.donated,
        seconds=seconds,
    )


def _where(c: Collective) -> str:
    if "NextNDraft" in c.op_name:
        return MTP
    return "outside" if c.layer is None else str(c.layer)


def collective_bytes(part: CompiledPart, trips: int | None = None) -> dict[str, dict[str, int]]:
    """Bytes (one chip's results) the compiled part moves per execution, by where (a layer index,
    ``"mtp"``, ``"outside"``: every key of ``part.minimum``) and kind; a collective in a loop's
    body counts ``trips`` times (default: the round's ``NUM_STEPS`` draft steps, the only loop
    with collectives in these parts)."""
    trips = NUM_STEPS if trips is None else trips
    found: dict[str, dict[str, int]] = {where: {} for where in part.minimum}
    for c in part.found:
        kinds = found.setdefault(_where(c), {})
        kinds[c.op] = kinds.get(c.op, 0) + c.nbytes * (trips if c.in_loop else 1)
    return found


def full_model_weight_bytes(
    part: CompiledPart, num_layers: int = 61, dense_layers: int = 3, vocab: int = 129280
) -> int:
    """Weights one chip would hold for the whole of DeepSeek-V3 laid out as ``part`` lays them
    out: from the compiled model's per-layer shards (layer 0 dense, layer 1 MoE), ``dense_layers``
    dense and ``num_layers - dense_layers`` MoE layers, the embedding and LM head at ``vocab``
    tokens (replicated), and for the round the MTP layer; shapes only (``jax.eval_shape``)."""
    from kvjax.serve.model import param_shapes
    from kvjax.serve.param_sharding import param_shardings

    spec = part.spec
    model = as_model_config(spec)
    mesh = topology_mesh(part.topology, part.group_size)
    shapes = param_shapes(model)
    shardings = param_shardings(shapes, model, mesh)

    def shard_bytes(tree: Any, sharding: Any) -> int:
        leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(sharding), strict=True)
        return sum(math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize for x, s in leaves)

    dense = shard_bytes(shapes["model"]["layers_0"], shardings["model"]["layers_0"])
    moe = shard_bytes(shapes["model"]["layers_1"], shardings["model"]["layers_1"])
    table = 2 * vocab * model.hidden_size * jnp.dtype(model.dtype).itemsize  # embedding and LM head
    total = dense_layers * dense + (num_layers - dense_layers) * moe + table
    if part.name in ("eagle_round", "dp_eagle_round"):
        total += moe + 2 * model.hidden_size * model.hidden_size * jnp.dtype(model.dtype).itemsize  # eh_proj
    return total
