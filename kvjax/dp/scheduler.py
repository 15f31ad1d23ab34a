"""`DPScheduler`: serving over DP ranks, a router in front of one ``Scheduler`` per rank.

SGLang's ``DataParallelController`` sends each request to one DP rank's scheduler; each rank
then serves it over its own cache (tree, allocator, request table, pools). This is that front:
``submit`` routes every request with a ``DPRouter`` (round robin or cache-aware) over the ranks'
trees and loads, and queues it on its rank's ``Scheduler``; ``step`` steps every rank that has
work, in rank order. The interface is the ``Scheduler``'s (``submit``, ``step``, ``idle``,
``run``, ``leak_free``), so ``kvjax.serve.workload.run_workload`` drives it unchanged.

Each rank's scheduler runs its own jitted step over its own ``KVCache``.
``kvjax.dp.lockstep.LockstepDPScheduler`` is the DP-attention form: one device step for every
rank's batch, over the stacked pools of ``build_dp_kv_cache``.

Determinism: routing depends only on the submission order, the requests, the ranks' trees and
their queues (``RankLoad`` from each scheduler's waiting, running and chunked requests), and the
ranks step in rank order: two runs of the same stream route and serve alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from kvjax.build import build_kv_cache
from kvjax.config import CacheConfig
from kvjax.errors import ConfigError
from kvjax.serve.dp_router import DEFAULT_MAX_LOAD_GAP_TOKENS, DPRouter, RankLoad
from kvjax.serve.scheduler import Scheduler, ServingReq
from kvjax.serve.serving_front import serve_to_completion
from kvjax.serve.sessions import check_turn, new_session_id
from kvjax.spec import ModelSpec

__all__ = ["DPScheduler"]


class DPScheduler:
    """A router in front of one ``Scheduler`` per DP rank (module docstring).

    Args:
        schedulers: one per rank, rank order, each over its own cache (distinct trees).
        policy: the router's policy, ``"cache_aware"`` or ``"round_robin"``.
        max_load_gap_tokens: the cache-aware overload margin (``kvjax.serve.dp_router``).

    Attributes:
        rank_of: the rank each submitted request went to, by request id.
    """

    def __init__(
        self,
        schedulers: Sequence[Scheduler],
        *,
        policy: str = "cache_aware",
        max_load_gap_tokens: int = DEFAULT_MAX_LOAD_GAP_TOKENS,
    ) -> None:
        trees = [s.tree for s in schedulers]
        if len({id(t) for t in trees}) != len(trees):
            raise ConfigError("schedulers", len(trees), "give every DP rank a scheduler over its own cache")
        self.schedulers = tuple(schedulers)
        self.router = DPRouter(trees, policy, max_load_gap_tokens=max_load_gap_tokens)
        self.rank_of: dict[Any, int] = {}
        self.finished: list[ServingReq] = []
        # Open sessions: (the rank their first turn was routed to, None before it; namespace).
        self._sessions: dict[str, tuple[int | None, Hashable]] = {}

    @classmethod
    def build(
        cls,
        spec: ModelSpec,
        config: CacheConfig,
        params: dict,
        *,
        policy: str = "cache_aware",
        max_load_gap_tokens: int = DEFAULT_MAX_LOAD_GAP_TOKENS,
        **scheduler_options: Any,
    ) -> DPScheduler:
        """``config.dp_size`` ranks, each with a cache ``build_kv_cache`` builds from the rank's
        plan and a ``Scheduler(spec, cache, params, **scheduler_options)``.

        Raises:
            ConfigError: DP attention off (``enable_dp_attention``).
            NotImplementedError: more than one device per rank (``tp_size / dp_size > 1``): build
                such ranks with ``LockstepDPScheduler.build_lockstep``.
        """
        if not config.enable_dp_attention:
            raise ConfigError("enable_dp_attention", False, "set it to serve over {dp_size} DP ranks")
        if config.attn_tp_size != 1:
            raise NotImplementedError(
                f"tp_size / dp_size = {config.attn_tp_size} devices per DP rank: DPScheduler.build makes one-device "
                "ranks; serve ranks of several devices with LockstepDPScheduler.build_lockstep(spec, config, params, "
                "mesh) over a ('data', 'tp') mesh"
            )
        schedulers = [
            Scheduler(spec, build_kv_cache(spec, config), params, **scheduler_options) for _ in range(config.dp_size)
        ]
        return cls(schedulers, policy=policy, max_load_gap_tokens=max_load_gap_tokens)

    @property
    def dp_size(self) -> int:
        return len(self.schedulers)

    def loads(self) -> list[RankLoad]:
        """Each rank's load: tokens and count of its waiting, running and chunked requests."""
        out = []
        for s in self.schedulers:
            reqs = [*s.waiting, *s.running, *([s.chunked] if s.chunked is not None else [])]
            out.append(RankLoad(sum(r.seqlen() for r in reqs), len(reqs)))
        return out

    def check_servable(self, reqs: Iterable[ServingReq]) -> None:
        """``ConfigError`` naming the first request no rank can serve (longer than the context,
        or whose KV can never fit a rank's pool); nothing changes. Every rank has the same plan:
        one rank's limits are every rank's. A turn of a session already on a rank is checked by
        that rank (with its history); a session turn that cannot be taken is a ``ValueError``."""
        reqs = list(reqs)
        fresh: list[ServingReq] = []
        by_rank: dict[int, list[ServingReq]] = {}
        seen: set[str] = set()
        for req in reqs:
            sid = req.session_id
            if sid is None:
                fresh.append(req)
                continue
            if sid not in self._sessions:
                raise KeyError(f"request {req.rid!r}: no open session {sid!r}; open it with open_session first")
            rank, extra_key = self._sessions[sid]
            # a turn in flight on its rank is the rank's to refuse (below, with its history)
            check_turn(req, extra_key, None, seen)
            if rank is None:
                fresh.append(req)
            else:
                by_rank.setdefault(rank, []).append(req)
        if fresh:
            self.schedulers[0].check_servable([r for r in fresh if r.session_id is None])
            for req in fresh:
                if req.session_id is not None:  # a first turn: no history yet
                    self.schedulers[0].check_servable([_without_session(req)])
        for rank, turns in by_rank.items():
            self.schedulers[rank].check_servable(turns)

    def submit(self, reqs: Iterable[ServingReq]) -> None:
        """Route and queue requests, in order. All or none: a request no rank can serve
        (``check_servable``) raises ``ConfigError`` before any is routed. A session's turns go to
        the rank its first turn was routed to (its KV is there)."""
        reqs = list(reqs)
        self.check_servable(reqs)
        for req in reqs:
            sid = req.session_id
            rank = self._sessions[sid][0] if sid is not None else None
            if rank is None:
                rank = self.router.route(req.origin_input_ids, self.loads(), req.extra_key)
                if sid is not None:
                    extra_key = self._sessions[sid][1]
                    self.schedulers[rank].open_session(sid, extra_key)
                    self._sessions[sid] = (rank, extra_key)
            self.rank_of[req.rid] = rank
            self.schedulers[rank].submit([req])

    def open_session(self, session_id: str | None = None, extra_key: Hashable = None) -> str:
        """Open a session (``kvjax.serve.sessions``); its first turn is routed like any request,
        and every later turn goes to the same rank. Returns its id."""
        session_id = new_session_id(session_id, self._sessions)
        self._sessions[session_id] = (None, extra_key)
        return session_id

    def close_session(self, session_id: str) -> None:
        """Close a session on its rank (``Scheduler.close_session``; ValueError while a turn of
        it is queued or running, KeyError for one not open)."""
        if session_id not in self._sessions:
            raise KeyError(f"no open session {session_id!r}; open it with open_session first")
        rank = self._sessions[session_id][0]
        if rank is not None:
            self.schedulers[rank].close_session(session_id)
        del self._sessions[session_id]

    def session_rank(self, session_id: str) -> int | None:
        """The rank serving the session (None before its first turn)."""
        return self._sessions[session_id][0]

    @property
    def idle(self) -> bool:
        return all(s.idle for s in self.schedulers)

    def step(self) -> list[ServingReq]:
        """One step of every rank with work, in rank order; the requests that finished."""
        done: list[ServingReq] = []
        for s in self.schedulers:
            if not s.idle:
                done.extend(s.step())
        self.finished.extend(done)
        return done

    def run(self, reqs: Iterable[ServingReq] = ()) -> list[ServingReq]:
        """Submit ``reqs`` and step until every request has finished (finishing order)."""
        return serve_to_completion(self, reqs)

    def leak_free(self) -> bool:
        """Every rank idle with no slot or row lost (``Scheduler.leak_free`` per rank)."""
        return all(s.leak_free() for s in self.schedulers)

    @property
    def prompt_tokens(self) -> int:
        return sum(s.stats.prompt_tokens for s in self.schedulers)

    @property
    def cached_tokens(self) -> int:
        return sum(s.stats.cached_tokens for s in self.schedulers)

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens, all ranks together."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _without_session(req: ServingReq) -> ServingReq:
    """A stand-in of a session's first turn for checking limits on a rank where it is not open."""
    return ServingReq(req.rid, req.origin_input_ids, max_new_tokens=req.max_new_tokens, extra_key=req.extra_key)
