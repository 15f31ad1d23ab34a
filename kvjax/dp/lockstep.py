"""`LockstepDPScheduler`: DP attention serving, every rank's batch in one device step.

SGLang's DP attention runs the DP ranks in lockstep: every rank forms its own batch from its own
queue, tree and allocator, then one forward runs all of them (attention per rank over its own
pool slice; ranks with nothing to run join with an idle batch). Here each rank keeps a kvjax
``Scheduler`` for the host side (admission, matching, allocation, metadata, finishing, without
overlap scheduling), over a ``KVCache`` that shares the rank's host objects of a
``DPKVCache`` and holds the stacked pools of all ranks. A scheduler's step function does not run
the model: it hands the rank's packed inputs to the round and waits. The front steps every rank
with work in a thread of its own; once each has either handed in its batch or finished its step
without one, the front stacks the batches (an empty batch for the other ranks), runs the one DP
step (``make_dp_step``) and gives every waiting rank its sampled tokens. Every rank's cache then
holds the new pools.

Determinism: the threads only wait for each other; each rank's host work is its own scheduler's
on its own objects, and the stacked step's input is the ranks' batches in rank order, so a run
is the same whatever order the threads run in. Every wait is bounded (``timeout_s``).

Scope: one device per rank (``make_dp_step``), full-attention caches (a kind with serving
extensions or pending device updates is refused).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kvjax.attention.metadata_builder import build_attention_metadata
from kvjax.build import KVCache
from kvjax.config import CacheConfig
from kvjax.dp.attention import stack_rank_inputs
from kvjax.dp.cache import DPKVCache, build_dp_kv_cache
from kvjax.dp.scheduler import DPScheduler
from kvjax.dp.step import make_dp_step, replicate_params
from kvjax.serve.dp_router import DEFAULT_MAX_LOAD_GAP_TOKENS
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.spec import ModelSpec

__all__ = ["LockstepDPScheduler"]

DEFAULT_TIMEOUT_S = 600.0


class _Round:
    """One lockstep step: the batches the ranks hand in and the tokens they get back."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.cond = threading.Condition()
        self.inputs: dict[int, tuple[np.ndarray, Any]] = {}
        self.finished: set[int] = set()
        self.outputs: dict[int, tuple[Any, np.ndarray]] = {}
        self.failed: BaseException | None = None

    def ready(self) -> bool:
        """Every rank handed in a batch or finished its step without one."""
        return all(r in self.inputs or r in self.finished for r in self.ranks)


class _RankStep:
    """A rank scheduler's step function: hand the batch to the current round, wait for the tokens."""

    def __init__(self, front: LockstepDPScheduler, rank: int) -> None:
        self.front = front
        self.rank = rank

    def __call__(self, pools: Any, params: Any, tokens: np.ndarray, meta: Any) -> tuple[Any, np.ndarray]:
        round_ = self.front._round
        if round_ is None:
            raise RuntimeError(f"rank {self.rank} stepped outside a lockstep round: step the LockstepDPScheduler")
        with round_.cond:
            round_.inputs[self.rank] = (tokens, meta)
            round_.cond.notify_all()
            if not round_.cond.wait_for(
                lambda: self.rank in round_.outputs or round_.failed is not None, self.front.timeout_s
            ):
                raise TimeoutError(f"rank {self.rank}: no DP step within {self.front.timeout_s} s")
            if round_.failed is not None:
                raise RuntimeError(f"rank {self.rank}: the DP step failed") from round_.failed
            return round_.outputs[self.rank]


class LockstepDPScheduler(DPScheduler):
    """DP attention serving: the router, a host scheduler per rank, one device step for all
    (module docstring). Build it with :meth:`build_lockstep`.

    Attributes:
        cache: the ``DPKVCache`` (its ``pools`` are every rank's current device state).
        dp_steps: device steps run.
    """

    def __init__(
        self,
        cache: DPKVCache,
        schedulers: list[Scheduler],
        step_fn: Any,
        params: Any,
        *,
        policy: str = "cache_aware",
        max_load_gap_tokens: int = DEFAULT_MAX_LOAD_GAP_TOKENS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(schedulers, policy=policy, max_load_gap_tokens=max_load_gap_tokens)
        self.cache = cache
        self.timeout_s = float(timeout_s)
        self._dp_step = step_fn
        self._params = params
        self._round: _Round | None = None
        self.dp_steps = 0
        for rank, scheduler in enumerate(schedulers):
            scheduler.step_fn = _RankStep(self, rank)

    @classmethod
    def build_lockstep(
        cls,
        spec: ModelSpec,
        config: CacheConfig,
        params: dict,
        mesh: Any,
        *,
        policy: str = "cache_aware",
        max_batch_size: int = 16,
        max_load_gap_tokens: int = DEFAULT_MAX_LOAD_GAP_TOKENS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> LockstepDPScheduler:
        """The DP cache over ``mesh`` (``build_dp_kv_cache``), a host scheduler per rank and the
        DP step. Raises as ``build_dp_kv_cache`` and ``make_dp_step`` do, and
        ``NotImplementedError`` for a cache kind with serving extensions."""
        cache = build_dp_kv_cache(spec, config, mesh)
        step_fn = make_dp_step(spec, cache.layout)
        schedulers = []
        for rank in cache.ranks:
            view = KVCache(
                plan=rank.plan,
                pools=cache.pools,
                req_to_token_pool=rank.req_to_token_pool,  # type: ignore[arg-type]
                token_to_kv_pool_allocator=rank.allocator,
                tree_cache=rank.tree_cache,
            )
            scheduler = Scheduler(spec, view, params, max_batch_size=max_batch_size, overlap=False)
            if scheduler.extensions:
                names = [type(e).__name__ for e in scheduler.extensions]
                raise NotImplementedError(f"lockstep DP serving of a cache with serving extensions {names}")
            schedulers.append(scheduler)
        return cls(
            cache,
            schedulers,
            step_fn,
            replicate_params(params, cache.layout),
            policy=policy,
            max_load_gap_tokens=max_load_gap_tokens,
            timeout_s=timeout_s,
        )

    def step(self) -> list[ServingReq]:
        """One lockstep step: every rank with work forms its batch, one DP step runs them all."""
        active = [r for r, s in enumerate(self.schedulers) if not s.idle]
        if not active:
            return []
        round_ = self._round = _Round(active)
        done: dict[int, list[ServingReq]] = {}
        errors: dict[int, BaseException] = {}

        def run(rank: int) -> None:
            try:
                done[rank] = self.schedulers[rank].step()
            except BaseException as e:  # handed to the front thread, which raises it
                errors[rank] = e
            finally:
                with round_.cond:
                    round_.finished.add(rank)
                    round_.cond.notify_all()

        threads = [threading.Thread(target=run, args=(r,), name=f"dp-rank-{r}", daemon=True) for r in active]
        for t in threads:
            t.start()
        try:
            with round_.cond:
                if not round_.cond.wait_for(round_.ready, self.timeout_s):
                    raise TimeoutError(f"DP ranks {active}: no batch within {self.timeout_s} s")
            if round_.inputs:
                self._run_dp_step(round_)
        except BaseException as e:
            with round_.cond:
                round_.failed = e
                round_.cond.notify_all()
            raise
        finally:
            for t in threads:
                t.join(self.timeout_s)
            self._round = None
        if errors:
            raise errors[min(errors)]
        finished = [req for r in active for req in done.get(r, [])]
        self.finished.extend(finished)
        return finished

    def _run_dp_step(self, round_: _Round) -> None:
        """Stack the handed-in batches (an empty one for every other rank), run the DP step, hand
        each waiting rank its tokens and every rank's cache the new pools."""
        tokens, metas = [], []
        for r, scheduler in enumerate(self.schedulers):
            if r in round_.inputs:
                t, m = round_.inputs[r]
            else:
                t, m = _idle_batch(scheduler)
            tokens.append(t)
            metas.append(m)
        stacked_tokens, stacked_meta = stack_rank_inputs(tokens, metas)
        pools, next_tokens = self._dp_step(self.cache.pools, self._params, stacked_tokens, stacked_meta)
        self.dp_steps += 1
        self.cache.set_pools(pools)
        for scheduler in self.schedulers:
            scheduler.cache.set_pools(pools)
        host_tokens = np.asarray(next_tokens)
        with round_.cond:
            for r in round_.inputs:
                round_.outputs[r] = (pools, host_tokens[r])
            round_.cond.notify_all()


def _idle_batch(scheduler: Scheduler) -> tuple[np.ndarray, Any]:
    """A rank's batch of no sequence (padding tokens on its trash page), in its step's shapes."""
    table = np.zeros((scheduler.max_batch_size, scheduler.pages_per_seq), np.int32)
    return build_attention_metadata(
        tokens=[],
        starts=np.zeros(0, np.int32),
        slots=np.zeros(0, np.int32),
        page_table=table,
        max_seqs=scheduler.max_batch_size,
    )
