"""`ServingExtension`: what a kind of cached state beyond full attention adds to the serving loop.

The scheduler (``scheduler.py``) runs SGLang's loop over the full-attention KV (match and lock,
evict then allocate, ``cache_unfinished_req`` / ``cache_finished_req``). Other kinds of state need
a little more at fixed points of that loop: a sliding-window pool frees the slots that left each
request's window and reads through its own page table; a recurrent-state pool gives each request a
state slot, forks the matched checkpoint into it and hands the step the slots of its sequence
rows; a host tier polls its transfers and loads matched host prefixes back. Each such kind is one
extension object (in its own module) built from the cache; the scheduler calls every extension's
hooks in order, and an MHA-only cache has none, so its loop pays nothing.

Hooks, in the order the scheduler calls them (every default does nothing):

=========================  ==================================================================
hook                       when
=========================  ==================================================================
``attach(scheduler)``      once, when the scheduler is built
``after_admit(req)``       a waiting request was matched and locked (``req.prefix_indices``,
                           ``req.last_node``) and got its request-table row; before memory for
                           its new tokens is made
``step_metadata(batch)``   the batch is packed: return this kind's part of the step's
                           ``AttentionMetadata`` (``SWAMetadata``, ``StateMetadata``, or a
                           ``MetadataPart`` of the kind's own: numpy, fixed shapes, padded to
                           ``batch.max_seqs`` rows), or None
``after_step(batch)``      the step ran and its pools are stored in the cache
``before_decode(reqs)``    a decode batch of ``reqs`` is about to allocate its new tokens
``before_release(req,``    the request's KV is about to go to the tree (``finished``: finished;
``finished)``              else retracted, released without insert)
``poll()``                 once per scheduler step, before the batch is formed (transfers)
``can_run_ahead(reqs)``    overlap scheduling: a decode batch of ``reqs`` is about to be
                           launched before the previous step's tokens are read; False makes
                           the scheduler read them first
=========================  ==================================================================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    from kvjax.attention import MetadataPart
    from kvjax.serve.serving_req import ServingReq

CachePart = TypeVar("CachePart")


class RequestAborted(Exception):
    """Raised by an extension's ``after_admit`` to end the request unserved (a disaggregated
    decode server whose prefill side failed): the scheduler releases what the admission took
    (its lock and row; the extension frees what it took itself first), sets the request's
    ``abort_reason`` to the message and returns it finished from the step."""


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's sequences as the scheduler packs them (``n`` live rows, in batch order).

    ``rows``: request-table rows ``[n]``; ``starts``: KV length before this step's tokens ``[n]``;
    ``seq_lens``: KV length after them ``[n]``; ``slots``: the new tokens' KV slots, concatenated;
    ``reqs``: the requests; ``max_seqs``: the step's padded row count; ``is_decode``: one token
    per sequence.
    """

    rows: np.ndarray
    starts: np.ndarray
    seq_lens: np.ndarray
    slots: np.ndarray
    reqs: Sequence[ServingReq]
    max_seqs: int
    is_decode: bool


class ServingExtension:
    """Base class of the per-kind serving hooks (see the module docstring); every hook is a no-op.

    ``keeps_session_kv``: a session's finished turn may keep its row and KV for the next turn
    with this kind in the cache (``kvjax.serve.sessions``): the kind keeps no per-request state
    that the hold would leave stale. False unless the kind says so."""

    keeps_session_kv: bool = False

    def attach(self, scheduler: Any) -> None:
        """Called once by the scheduler that runs this extension (before any other hook)."""

    def poll(self) -> None:
        """Once per scheduler step, before the batch is formed."""

    def after_admit(self, req: ServingReq) -> None:
        """``req`` was matched, locked and given a request-table row."""

    def before_decode(self, reqs: Sequence[ServingReq]) -> None:
        """A decode batch of ``reqs`` is about to allocate one token each."""

    def step_metadata(self, batch: StepBatch) -> MetadataPart | None:
        """This kind's part of the batch's ``AttentionMetadata`` (numpy, fixed shapes), placed at
        the part's field by the metadata builder; None: nothing (the default)."""
        return None

    def after_step(self, batch: StepBatch) -> None:
        """The step ran; the cache holds its new pools."""

    def before_release(self, req: ServingReq, finished: bool) -> None:
        """``req``'s KV is about to be cached (``finished``) or released without insert (retraction)."""

    def can_run_ahead(self, reqs: Sequence[ServingReq]) -> bool:
        """Whether a decode step of ``reqs`` may run while the previous step's tokens are unread.
        A request that stopped on a stop token in that step then gets one speculative step: its
        KV slot is released exactly by the scheduler, but state this kind keeps per request and
        hands to the tree on release must not have advanced; say False when it would have."""
        return True

    def in_lockstep(self, layout: Any, rank: int, shared: dict[str, Any]) -> bool:
        """Adapt this extension to DP rank ``rank`` of lockstep DP serving (``kvjax.dp.lockstep``:
        every rank's pools stacked in one array over ``layout``, ``kvjax.dp.cache.DPLayout``), and
        say whether it runs there. ``shared``: one dict for every extension of every rank (where
        the ranks' extensions keep what they share). Default False: an extension that records
        device updates must write only its rank's slice; one whose work is all on the host says
        True."""
        return False


def required_part(part: Any, kind: type[CachePart], extension: str) -> CachePart:
    """``part`` of the cache an extension is built from (its tree, request table, ...) when it is a
    ``kind``; a ``TypeError`` saying that ``extension`` needs one otherwise (a cache of another kind)."""
    if not isinstance(part, kind):
        raise TypeError(f"{extension} needs a {kind.__name__}, got {type(part).__name__}")
    return part
