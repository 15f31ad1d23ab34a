"""`TreeServer`: the scheduler's part of serving that the KV events see, without a model: the
demo workload (``kvjax.serve.workload.run_workload``) through a radix tree over a real allocator
(and a host tier over a simulated copy engine), outputs drawn from a seeded generator, each step
matching (loading host hits back), evicting to make room, inserting and polling the transfers.
The same interface as a ``Scheduler`` where ``attach_kv_events`` and ``run_workload`` use it."""

from __future__ import annotations

import collections
import random

from kvjax.alloc import make_allocator
from kvjax.radix import HiRadixCache, RadixCache
from kvjax.tiers import SimulatedCopyEngine


class TreeServer:
    def __init__(
        self,
        page_size: int,
        capacity: int,
        *,
        host_tokens: int | None = None,
        write_policy: str = "write_through",
        max_batch: int = 4,
        seed: int = 0,
        vocab: int = 256,
    ) -> None:
        self.page_size = page_size
        self.alloc = make_allocator(capacity, page_size)
        if host_tokens:
            self.tree: RadixCache = HiRadixCache(
                page_size=page_size,
                token_to_kv_pool_allocator=self.alloc,
                host_pool_tokens=host_tokens,
                copy_engine=SimulatedCopyEngine(),
                write_policy=write_policy,
                load_back_threshold=page_size,
            )
        else:
            self.tree = RadixCache(page_size=page_size, token_to_kv_pool_allocator=self.alloc)
        self.host = host_tokens is not None
        self.extensions: tuple = ()
        self.finished: list = []
        self.waiting: collections.deque = collections.deque()
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.max_batch = max_batch
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.loaded_back = 0

    @property
    def idle(self) -> bool:
        return not self.waiting

    def submit(self, reqs) -> None:
        for r in reqs:
            self.prompt_tokens += len(r.origin_input_ids)
            self.waiting.append(r)

    def step(self) -> list:
        for ext in self.extensions:
            ext.poll()
        tree = self.tree
        if self.host:
            tree.check_transfers()
        done = []
        for _ in range(min(self.max_batch, len(self.waiting))):
            req = self.waiting.popleft()
            self._serve(req)
            done.append(req)
        self.finished.extend(done)
        return done

    def _serve(self, req) -> None:
        tree, alloc, ps = self.tree, self.alloc, self.page_size
        prompt = list(req.origin_input_ids)
        m = tree.match_prefix(prompt)
        if self.host:
            before = m.prefix_len
            m = tree.init_load_back(m)
            self.loaded_back += m.prefix_len - before
        self.cached_tokens += m.prefix_len
        output = [self.rng.randrange(self.vocab) for _ in range(req.max_new_tokens)]
        req.output_ids = output
        key = prompt + output
        key = key[: len(key) - len(key) % ps]
        if not key:
            return
        receipt = tree.inc_lock_ref(m.last_node)
        if alloc.available_size() < len(key):
            tree.evict(len(key) - alloc.available_size())
        if alloc.available_size() < len(key) and self.host:
            tree.check_transfers(wait=True)  # pending backups lock their nodes
            tree.evict(len(key) - alloc.available_size())
        tree.dec_lock_ref(receipt)
        if alloc.available_size() < len(key):
            tree.evict(len(key) - alloc.available_size())
        slots = alloc.alloc(len(key))
        assert slots is not None, "the pool holds one request"
        prefix = tree.insert(key, slots)
        held = tree.match_prefix(key).indices[:prefix]
        alloc.free(slots[:prefix][slots[:prefix] != held])
