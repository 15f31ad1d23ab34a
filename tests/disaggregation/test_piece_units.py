"""`PieceUnits`: the unit plan both sides of a disaggregated pair compute from their layouts.

For sides of one or several processes, any device counts and head counts: every unit a receiving
process's devices hold is offered to it by exactly one sending process, one whose devices hold
it; a process is offered nothing it does not hold; the units of a block tile it in order."""

from __future__ import annotations

import itertools

import pytest

from kvjax.disaggregation.piece_units import PieceUnits, SideLayout
from kvjax.transfers.request_kv import PieceSpec

ROWS = PieceSpec("rows", (2, 5, 4, 4), "float32", head_axis=2, token_axis=1)  # a head axis of 4 (2 KV heads' K and V)
SCALES = PieceSpec("k_scale", (2,), "float32")  # no head axis: one unit, whole

LAYOUTS = {
    "one device": SideLayout((0,)),
    "tp 2, one process": SideLayout((0, 0)),
    "tp 4, one process": SideLayout((0, 0, 0, 0)),
    "tp 4 over 2 processes": SideLayout((0, 0, 1, 1)),
    "tp 8 over 4 processes": SideLayout((0, 0, 1, 1, 2, 2, 3, 3)),
    "tp 2 over 2 processes": SideLayout((0, 1)),
    "tp 6, one process": SideLayout((0,) * 6),
}


@pytest.mark.parametrize("sender, receiver", list(itertools.product(LAYOUTS, repeat=2)))
def test_every_unit_a_process_holds_is_offered_to_it_once_by_a_process_holding_it(sender, receiver):
    plan = PieceUnits((ROWS, SCALES), LAYOUTS[sender], LAYOUTS[receiver])
    for piece, spec in enumerate(plan.specs):
        units = plan.units(piece)
        assert units == (1 if spec.head_axis is None else units)
        for unit in range(units):
            owner = plan.owner(piece, unit)
            position = plan.owner_position(piece, unit)
            # the owner's device holds the unit's block on the sending side
            block = unit * plan.sender.blocks(spec) // units
            assert position in plan.sender.block_devices(spec, block) and plan.sender.processes[position] == owner
            for process in plan.receiver.process_ids:
                offers = [s for s in plan.sender.process_ids if (piece, unit) in plan.offered(s, process)]
                assert offers == ([owner] if process in plan.needed_by(piece, unit) else [])


def test_units_are_the_lcm_of_both_sides_blocks_and_tile_each_block():
    plan = PieceUnits((ROWS,), LAYOUTS["tp 2, one process"], LAYOUTS["tp 8 over 4 processes"])
    # a head axis of 4: 2 blocks on the sender, gcd(8, 4) = 4 on the receiver: units of one row
    assert (plan.units(0), plan.unit_heads(0), plan.unit_shape(0)) == (4, 1, (2, 5, 1, 4))
    assert [plan.unit_range(0, u, plan.sender) for u in range(4)] == [(0, 1), (1, 2), (0, 1), (1, 2)]
    assert [plan.unit_range(0, u, plan.receiver) for u in range(4)] == [(0, 1)] * 4
    # receiving process q holds devices 2q, 2q + 1: head block q, so unit q
    assert [plan.offered(0, q) for q in range(4)] == [[(0, 0)], [(0, 1)], [(0, 2)], [(0, 3)]]
    back = PieceUnits((ROWS, SCALES), LAYOUTS["tp 4 over 2 processes"], LAYOUTS["one device"])
    # four units of one row, two on each sending process; the scales (no head axis) come from the
    # first device's process
    assert back.offered(0, 0) == [(0, 0), (0, 1), (1, 0)] and back.offered(1, 0) == [(0, 2), (0, 3)]


def test_a_head_count_that_no_device_count_divides_is_cut_by_common_divisors():
    six = PieceSpec("rows", (1, 3, 12, 4), "float32", head_axis=2, token_axis=1)  # 6 KV heads' K and V
    plan = PieceUnits((six,), LAYOUTS["tp 4 over 2 processes"], LAYOUTS["tp 6, one process"])
    # blocks: gcd(4, 12) = 4 and gcd(6, 12) = 6, units lcm = 12: one K or V row each
    assert (plan.units(0), plan.unit_heads(0)) == (12, 1)
    assert sorted(plan.offered(0, 0) + plan.offered(1, 0)) == [(0, u) for u in range(12)]
    assert {u for _, u in plan.offered(1, 0)} == set(range(6, 12))
