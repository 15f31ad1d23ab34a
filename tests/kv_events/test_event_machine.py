"""The host-tier state machine (``tests/radix/test_hiradix_machine.py``: inserts, matches with
load-back, device and host eviction, demotion, revival, failed backups and loads, every write
policy) with KV events on: after every step, the in-process event stream applied in order gives
exactly the tree's cached blocks per medium (``cached_blocks``), for kvjax's hash and vLLM's."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import initialize, invariant

from kvjax.kv_events.block_hash import Sha256CborHasher
from kvjax.kv_events.blocks import cached_blocks
from kvjax.radix import events as tree_events
from tests.radix.test_hiradix_machine import HostTierMachine


class EventMachine(HostTierMachine):
    @initialize(
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
        host_tokens=st.sampled_from([8, 24]),
        vllm_hash=st.booleans(),
    )
    def choose_policy(self, policy, host_tokens, vllm_hash):
        self._build(policy, host_tokens)
        self.stream: list = []
        self.tree.start_events(self.stream, Sha256CborHasher("0") if vllm_hash else None)

    @invariant()
    def stream_rebuilds_the_cached_blocks(self):
        if not hasattr(self, "stream"):
            return
        wire = self.tree.block_hasher.wire_hash
        blocks: set = set()
        for e in self.stream:
            if isinstance(e, tree_events.BlockStored):
                assert len(e.token_ids) >= e.block_size * len(e.block_hashes)
                new = {(e.medium, wire(h)) for h in e.block_hashes}
                assert not new & blocks, "a block reported stored twice in one medium"
                blocks |= new
            elif isinstance(e, tree_events.BlockRemoved):
                gone = {(e.medium, wire(h)) for h in e.block_hashes}
                assert gone <= blocks, "a block reported removed that was not stored"
                blocks -= gone
            else:
                blocks.clear()
        assert blocks == cached_blocks(self.tree, wire_media=False)


EventMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestEventMachine = EventMachine.TestCase
