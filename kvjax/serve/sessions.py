"""Sessions: a conversation's KV kept between its turns (SGLang's ``open_session`` /
``session_params`` / ``close_session``, with the streaming session's hold).

A session is opened on a scheduler (``Scheduler.open_session``) and named on each turn
(``ServingReq(..., session_id=...)``). A turn's prompt holds only its new tokens: at submission
the session prepends its history (every earlier turn's prompt and output, in order), so the model
sees the whole conversation, as SGLang's session requests do (append mode: no branching from an
earlier turn, no ``replace``/``offset``). One turn at a time: a turn is refused while the
previous one has not finished.

**The hold.** When a turn finishes, its KV is not released: the request's prompt and output are
cached in the tree (``cache_unfinished_req``: inserted, and the lock moved to the new last node),
and the request keeps its row of the request table with its unaligned last page. The next turn
takes that row over at admission (``resume``): its prefix is the previous turn's KV as it is, with
no match from the root, so it prefills only its new tokens and the previous turn's last output
token (whose KV no step wrote). ``close`` releases the hold in bulk (``cache_finished_req``: the
KV stays in the tree, unlocked, for whoever matches it; the row and the tail are freed).

**Never a deadlock** (SGLang's issue 27024, where pinned session KV starved the server): a hold is
always releasable. When memory or rows are short, the scheduler releases holds, least recently
used first, sessions with no turn queued before those whose next turn waits, before it retracts a
running request (``release_one``). A released session keeps its history; its next turn matches it
from the root like any request (hitting what the tree, or its host tier, still has). A turn that
is retracted releases its KV like any request, and the session goes on the same way.

A resumed turn skips the extensions' admission hooks (no load-back, no prefetch: its KV is on
the device). Caches whose kinds keep per-request state beyond full-attention KV (sliding
windows, recurrent state: extensions without ``keeps_session_kv``; the host tier has it), and
speculative decoding (a draft model's KV beside the target's), do not hold: each
turn matches its history from the root (SGLang wraps trees without streaming support in
``StreamingSession`` the same way). ``holds`` says which.

Invariant: a held request is in ``held_requests()`` (the scheduler's ``live_requests``), so
``available + evictable + protected + held == capacity`` counts its KV; with every session closed
(or released), nothing of a session remains in the allocator or the request table.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvjax.protocols import ReqToTokenPoolProtocol, TreeCacheProtocol
from kvjax.serve.serving_req import ServingReq

__all__ = ["Session", "SessionHost", "SessionTable", "check_turn", "new_session_id"]


def new_session_id(session_id: str | None, open_ids: Container[str]) -> str:
    """The id a new session gets: ``session_id``, else the first ``"session-N"`` not in
    ``open_ids``. ValueError naming an id that is not a non-empty string or is open already."""
    if session_id is None:
        return next(f"session-{n}" for n in itertools.count() if f"session-{n}" not in open_ids)
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id={session_id!r}: give a non-empty string")
    if session_id in open_ids:
        raise ValueError(f"session {session_id!r} is already open; close it first or choose another id")
    return session_id


def check_turn(req: ServingReq, extra_key: Hashable, in_flight: Any, seen: set[str]) -> None:
    """ValueError when ``req`` cannot be its session's next turn: a turn of it in flight
    (``in_flight``: that request, else None) or earlier in this submission (``seen``: the session
    ids met so far, to which ``req``'s is added), or a cache namespace other than the session's
    ``extra_key``."""
    sid = req.session_id
    assert sid is not None
    if in_flight is not None or sid in seen:
        other = in_flight.rid if in_flight is not None else "one earlier in this submission"
        raise ValueError(
            f"request {req.rid!r}: session {sid!r} has a turn in flight ({other!r}); a session takes one "
            "turn at a time: submit the next after it finishes"
        )
    if req.extra_key is not None and req.extra_key != extra_key:
        raise ValueError(
            f"request {req.rid!r}: extra_key {req.extra_key!r} differs from its session's "
            f"({extra_key!r}); a session's turns share one cache namespace"
        )
    seen.add(sid)


class SessionHost(Protocol):
    """What a session table needs of its scheduler: the tree its holds live in, the request table
    their rows come from, and what decides whether a turn can hold (the serving extensions, each
    with ``keeps_session_kv``, and the speculative proposer, None without one)."""

    @property
    def tree(self) -> TreeCacheProtocol: ...

    @property
    def rows(self) -> ReqToTokenPoolProtocol: ...

    @property
    def extensions(self) -> Sequence[Any]: ...

    @property
    def proposer(self) -> Any: ...


@dataclass
class Session:
    """One open session.

    Attributes:
        session_id: its name (unique among the open sessions of a scheduler).
        extra_key: the cache namespace (tenant salt) every turn of it uses.
        history: token ids of every finished turn's prompt and output, in order (int32).
        turns: finished turns.
        pending: the turn submitted and not finished yet (None: none).
        held: the last finished turn, still holding its row and its KV (None: released or none).
        used: logical time of the last turn's submission or finish (for least-recently-used release).
    """

    session_id: str
    extra_key: Hashable
    history: np.ndarray
    turns: int = 0
    pending: ServingReq | None = None
    held: ServingReq | None = None
    used: int = 0


class SessionTable:
    """A scheduler's open sessions and their holds (module docstring)."""

    def __init__(self, scheduler: SessionHost) -> None:
        self._sched = scheduler
        self._sessions: dict[str, Session] = {}
        self._clock = itertools.count(1)
        self.released = 0  # holds released under memory pressure (not by close)

    @property
    def holds(self) -> bool:
        """Whether finished turns keep their KV: no extension state and no draft model's to carry
        (module docstring)."""
        sched = self._sched
        return sched.proposer is None and all(ext.keeps_session_kv for ext in sched.extensions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session:
        """The open session ``session_id`` (KeyError naming it and the open ones otherwise)."""
        try:
            return self._sessions[session_id]
        except KeyError:
            open_ids = sorted(self._sessions)
            raise KeyError(
                f"no open session {session_id!r} (open: {open_ids}); open it with open_session first"
            ) from None

    # --- lifecycle ----------------------------------------------------------------------------------

    def open(self, session_id: str | None = None, extra_key: Hashable = None) -> str:
        """Open a session; returns its id (``session_id`` or a new ``"session-N"``). ValueError
        naming an id already open."""
        session_id = new_session_id(session_id, self._sessions)
        self._sessions[session_id] = Session(session_id, extra_key, np.empty(0, np.int32), used=next(self._clock))
        return session_id

    def close(self, session_id: str) -> None:
        """Release the session's hold and forget it. Refused (ValueError, nothing changes) while a
        turn of it is queued or running: close after that turn finishes."""
        session = self.get(session_id)
        if session.pending is not None:
            raise ValueError(
                f"session {session_id!r} has a turn in flight (request {session.pending.rid!r}); "
                "close it after that turn finishes"
            )
        self._release(session)
        del self._sessions[session_id]

    # --- turns --------------------------------------------------------------------------------------

    def check_turns(self, reqs: list[ServingReq]) -> None:
        """ValueError for the first turn that cannot be submitted (unknown session, a turn in
        flight, two turns of one session in ``reqs``, another cache namespace); changes nothing."""
        seen: set[str] = set()
        for req in reqs:
            if req.session_id is not None:
                session = self.get(req.session_id)
                check_turn(req, session.extra_key, session.pending, seen)

    def as_submitted(self, req: ServingReq) -> ServingReq:
        """A stand-in for checking limits: a request like ``req`` whose prompt is the session's
        history and ``req``'s prompt (``req`` itself when the session has none yet)."""
        session = self.get(req.session_id)  # type: ignore[arg-type]
        if not len(session.history):
            return req
        prompt = np.concatenate([session.history, np.asarray(req.origin_input_ids, np.int32)])
        return ServingReq(req.rid, prompt, max_new_tokens=req.max_new_tokens, extra_key=session.extra_key)

    def begin(self, req: ServingReq) -> None:
        """A turn is submitted (``check_turns`` passed): prepend the history, take the session's
        namespace, mark it pending."""
        session = self.get(req.session_id)  # type: ignore[arg-type]
        if len(session.history):
            prompt = np.asarray(req.origin_input_ids, np.int32)
            req.origin_input_ids = np.concatenate([session.history, prompt])
        req.extra_key = session.extra_key
        session.pending = req
        session.used = next(self._clock)

    def resume(self, req: ServingReq) -> int | None:
        """Admission of a turn whose session holds the previous turn: move the hold's row, lock
        and KV onto ``req``; returns the tokens of KV it starts with. None: nothing held (the
        scheduler matches the history from the root)."""
        if req.session_id is None:
            return None
        session = self._sessions[req.session_id]
        held = session.held
        if held is None:
            return None
        session.held = None
        start = held.kv_len()
        if held is not req:
            req.req_pool_idx, held.req_pool_idx = held.req_pool_idx, None
            req.prefix_indices = held.prefix_indices
            req.last_node, held.last_node = held.last_node, None
            req.lock_receipt, held.lock_receipt = held.lock_receipt, None
            req.cache_protected_len = held.cache_protected_len
            req.cache_inserted_len = held.cache_inserted_len
        req.kv_committed_len = None
        return start

    def unresume(self, req: ServingReq, start: int) -> None:
        """An admission ``resume`` began found no memory: the session holds again (``req``
        holds the row and KV up to ``start`` until it is admitted or released)."""
        req.kv_committed_len = start
        self._sessions[req.session_id].held = req  # type: ignore[index]

    def finish(self, req: ServingReq) -> bool:
        """A turn finished: record its tokens in the history and (``holds``) keep its KV: cache
        it in the tree with the lock kept, and keep its row. Returns whether it holds (the
        scheduler then neither releases its KV nor frees its row)."""
        if req.session_id is None or req.session_id not in self._sessions:
            return False
        session = self._sessions[req.session_id]
        if session.pending is not req:
            return False
        session.pending = None
        session.turns += 1
        session.used = next(self._clock)
        session.history = np.concatenate(
            [np.asarray(req.origin_input_ids, np.int32), np.asarray(req.output_ids, np.int32)]
        )
        if not self.holds:
            return False
        self._sched.tree.cache_unfinished_req(req)
        session.held = req
        return True

    # --- memory -------------------------------------------------------------------------------------

    def held_requests(self) -> list[ServingReq]:
        """The requests holding a session's KV and row (the scheduler counts them as live)."""
        return [s.held for s in self._sessions.values() if s.held is not None]

    def release_one(self) -> bool:
        """Release one hold under memory pressure: the least recently used session with no turn
        queued, else the least recently used whose next turn waits. False: none holds."""
        holding = [s for s in self._sessions.values() if s.held is not None]
        if not holding:
            return False
        victim = min(holding, key=lambda s: (s.pending is not None, s.used))
        self._release(victim)
        self.released += 1
        return True

    def _release(self, session: Session) -> None:
        held = session.held
        if held is None:
            return
        session.held = None
        sched = self._sched
        sched.tree.cache_finished_req(held)
        sched.rows.free(held.req_pool_idx)
        held.req_pool_idx = None
