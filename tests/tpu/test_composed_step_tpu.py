"""DeepSeek-V3's serving composition compiled for a 16-chip TPU slice without a TPU
(``kvjax.serve.abstract_composed``): the composed step, every DP rank's MTP (EAGLE) speculative
round in one program (``kvjax.dp.speculative.make_dp_round_step``) at dp 2 x tp 8, with
DeepSeek-V3's layer sizes (one dense and one MoE layer, the MTP layer MoE too), on
``v5p:2x2x4`` (95 GiB of HBM per chip). With MTP drafting, every decode step of the composition
is this round (and every prefill the paired prefill), so it covers DP attention, TP and the
draft together; the plain DP step (``make_dp_step``) and the round at tp 16 are compiled by
``benchmarks/composed_collectives.py`` (the same checks of its collectives hold there: ratio 1),
not here, to keep this file's compile time small: each program holds DeepSeek-V3's 256 routed
experts per MoE layer (each chip its slice of every expert) and compiles in one to three minutes
on two CPU cores. From the compiled
program (``kvjax.serve.compiled_step``):

* the Mosaic kernels are there (``tpu_custom_call``): one MLA attention kernel per target layer,
  and the MTP layer's in the round's draft chain;
* every pool buffer (and the round's hidden-state store) is donated and aliased to an output:
  each is in ``input_output_alias`` and the aliased bytes cover their per-chip shards;
* the collectives are the minimum (the module docstring of ``abstract_composed``), per layer, by
  kind and bytes, and over the rank's 8 chips: nothing crosses ``"data"`` inside the layers; outside
  them only the gather of every rank's proposals and greedy tokens to every host (the slice spans
  4 hosts);
* the per-chip bytes (weights as shapes, pools, temporaries from ``memory_analysis``) are what the
  arguments' shards add up to (TPU tiling pads the small metadata arrays: under 1 MiB), and are
  reported against the chip's HBM (printed; ``-s`` shows them), with the whole model's weights
  per chip for scale.

The routed experts are split over the TP group by their intermediate dimension
(``kvjax.serve.param_sharding``): one DeepSeek-V3 MoE layer's 21 GiB of experts is 2.6 GiB per
chip at tp 8, and the MoE block's one all-reduce is in the per-layer minimum checked here.
``v6e:4x4`` (32 GiB per chip) compiles too (``benchmarks/composed_collectives.py`` reports it);
it is not compiled here, to keep this file's compile time small.

The compile runs once per module (``functools.cache``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(900)

TOPOLOGIES = ["v5p:2x2x4"]
PADDING = 1 << 20  # TPU tiling of the small arguments (metadata, tokens)
PARTS = ["dp_eagle_round"]


@functools.cache
def _part(name: str, topology: str) -> Any:
    from kvjax.serve.abstract_composed import compile_part

    return compile_part(name, topology)


@pytest.mark.parametrize("name", PARTS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_mosaic_kernels_and_every_pool_updated_in_place(topology: str, name: str) -> None:
    from kvjax.serve.abstract_composed import LAYERS
    from kvjax.serve.compiled_step import aliased_parameters, entry_parameters, mosaic_kernels

    part = _part(name, topology)
    # one MLA kernel per target layer; the round's draft chain runs the MTP layer's in its loop
    kernels = LAYERS + (1 if name.endswith("eagle_round") else 0)
    assert mosaic_kernels(part.text) >= kernels, f"{name} on {topology}: fewer Mosaic kernels than {kernels}"
    parameters = entry_parameters(part.text)
    pools = {n for n, label in parameters.items() if label.startswith(part.donated)}
    assert len(pools) >= LAYERS, parameters
    missing = sorted(parameters[n] for n in pools - aliased_parameters(part.text))
    assert not missing, f"{name} on {topology}: pool buffers not aliased to an output: {missing}"
    assert part.memory.alias_size_in_bytes >= part.pool_bytes, (
        f"{name} on {topology}: {part.memory.alias_size_in_bytes} bytes aliased; the pools' shards: {part.pool_bytes}"
    )


@pytest.mark.parametrize("name", PARTS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_collectives_are_the_minimum_per_layer(topology: str, name: str) -> None:
    from kvjax.serve.abstract_composed import DP, collective_bytes

    part = _part(name, topology)
    found = collective_bytes(part)
    outside = found.pop("outside")
    minimum = dict(part.minimum)
    least_outside = minimum.pop("outside")
    assert found == minimum, f"{name} on {topology}: collective bytes {found}, the minimum {minimum}"
    # outside the layers: the sampled tokens of every DP rank to every host (several hosts), the
    # same bytes whichever collective XLA gathers them with
    assert sum(outside.values()) == sum(least_outside.values()), (name, topology, outside, least_outside)
    for c in part.found:
        if c.layer is not None or "NextNDraft" in c.op_name:
            assert c.group_size == part.group_size, f"{name} on {topology}: {c} not over the TP group"
            assert c.op == "all-reduce", c
        else:
            assert c.group_size == DP, f"{name} on {topology}: {c} outside the layers not over 'data'"


@pytest.mark.parametrize("name", PARTS)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_per_chip_bytes_against_the_chips_hbm(topology: str, name: str) -> None:
    from kvjax.serve.abstract_composed import full_model_weight_bytes

    part = _part(name, topology)
    memory = part.memory
    arguments = part.weight_bytes + part.pool_bytes + part.input_bytes
    assert 0 <= memory.argument_size_in_bytes - arguments < PADDING, (memory.argument_size_in_bytes, arguments)
    assert memory.output_size_in_bytes - memory.alias_size_in_bytes < 1 << 20, memory  # tokens, not pools
    full = full_model_weight_bytes(part)
    gib = 1 << 30
    total = memory.argument_size_in_bytes + memory.temp_size_in_bytes
    print(
        f"\n{name} on {topology} (compiled in {part.seconds:.0f} s), per chip, HBM {part.hbm_bytes / gib:.0f} GiB: "
        f"weights {part.weight_bytes / gib:.2f} GiB, pools {part.pool_bytes / gib:.3f} GiB, "
        f"temporaries {memory.temp_size_in_bytes / gib:.2f} GiB, total {total / gib:.2f} GiB "
        f"({total / part.hbm_bytes:.0%} of HBM); the whole model's weights {full / gib:.0f} GiB "
        f"({full / part.hbm_bytes:.1f}x HBM)"
    )
    assert full > part.weight_bytes


def test_the_abstract_round_is_packed_as_the_scheduler_packs_it() -> None:
    """``eagle_round_batch`` gives the draft steps' and the verify forward's metadata that the
    EAGLE scheduler packs (``proposer.draft_metadata``, ``verifier.verify_metadata``) for the same
    rows, slots and request table: every field equal, the page tables over the pages each row's
    KV length covers (the scheduler's tables zero the pages past it)."""
    import numpy as np

    from kvjax.attention import MetadataBuilder
    from kvjax.req_pool import ReqToTokenPool
    from kvjax.serve.abstract_eagle_round import eagle_round_batch
    from kvjax.serve.abstract_step import DecodeBatch
    from kvjax.serve.speculative.proposer import draft_metadata
    from kvjax.serve.speculative.verifier import verify_metadata

    page, steps, batch = 16, 3, DecodeBatch(seqs=4, context=50)
    first, drafts, verify = eagle_round_batch(batch, steps, page, pool_tokens=1024)
    pages = batch.pages_per_seq(page)
    table = ReqToTokenPool(batch.seqs, pages * page)
    slots_of_row = (1 + np.arange(batch.seqs * pages).reshape(batch.seqs, pages))[:, :, None] * page + np.arange(page)
    table.req_to_token[:] = slots_of_row.reshape(batch.seqs, -1)
    builder = MetadataBuilder(table, page, batch.seqs)
    rows = np.arange(batch.seqs)
    committed = np.full(batch.seqs, batch.context - steps - 1)
    slots = table.req_to_token[rows[:, None], committed[:, None] + np.arange(steps + 1)]
    want_drafts = draft_metadata(builder, committed, rows, slots, steps + 1)
    _, want_verify = verify_metadata(builder, committed, rows, slots, batch.seqs)
    assert first.shape == (batch.seqs,)
    for got, want in ((drafts, want_drafts), (verify, want_verify)):
        for field in ("positions", "out_loc", "kv_lens", "cu_q_lens", "num_seqs", "logits_indices"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
        mine, theirs = np.asarray(got.page_indices), np.asarray(want.page_indices)
        used = theirs != 0
        assert used.any() and np.array_equal(mine[used], theirs[used])


@pytest.mark.parametrize(
    ("instruction", "size"),
    [
        ("replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}", 4),
        ("replica_groups=[2,8]<=[16], use_global_device_ids=true", 8),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=8] {'axis_0'}, use_global_device_ids=true", 2),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_0','axis_1'}, use_global_device_ids=true", 16),
        ("channel_id=3", 0),
    ],
)
def test_replica_group_sizes_are_read_in_each_form(instruction: str, size: int) -> None:
    from kvjax.serve.compiled_step import replica_group_size

    assert replica_group_size(instruction) == size
