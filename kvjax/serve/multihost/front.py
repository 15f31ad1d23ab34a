"""`MultiProcessFront`: one process's part of multi-process serving (a ``ServingFront``).

Every process runs the same scheduler over its own copy of the tree, allocator and request table,
and one mesh spans all processes' devices, so every step is one SPMD program that all processes
launch together. What keeps the copies equal:

* requests enter on process 0: ``submit`` there queues them; elsewhere it ignores them (a
  multi-controller program runs one driver everywhere, and only process 0's input counts).
  Before each step (``idle`` or ``step``) the processes exchange one `StepMessage`: process 0's
  new requests with the step they arrive at, which every process submits to its scheduler in
  the same order, so every process admits the same batch;
* a request with images (made by the scheduler's ``MultimodalExtension``, found among its
  ``extensions``) travels with its unpadded prompt and pixels, and every other process makes it
  through its own extension, so every process holds the same items and pixels and makes the same
  embedding-cache decisions; one whose images cannot travel is refused at ``submit``;
* the scheduler's decisions depend only on that state (no wall-clock time, no local queue
  length); asynchronous completions are agreed (``Agreement``, passed to the scheduler);
* with ``check_agreement``, each message also carries the sender's state digest
  (``kvjax.multihost.digest``) and every process compares them: the first divergent step
  raises ``DivergenceError`` naming what differs.

Call pattern: every process makes the same calls in the same order (``idle``, ``step``,
``submit`` on process 0 only). ``idle`` always exchanges (so every process learns whether process
0 has new requests); ``step`` exchanges unless the call before it was ``idle``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from kvjax.multihost.channel import Channel
from kvjax.multihost.digest import compare_digests, serving_digest
from kvjax.multihost.errors import DivergenceError
from kvjax.serve.multihost.request_broadcast import RequestSpec, StepMessage
from kvjax.serve.multimodal_extension import MultimodalExtension
from kvjax.serve.serving_front import serve_to_completion
from kvjax.serve.serving_req import ServingReq

__all__ = ["MultiProcessFront"]


class MultiProcessFront:
    """``scheduler`` served in step with the other processes of ``channel`` (module docstring).

    Attributes:
        finished: the scheduler's finished requests (the same list).
        steps: steps taken (equal on every process).
        exchange_seconds: host time spent in the step exchanges (digests included).
        digest_checks: exchanges whose digests were compared.
        ignored_submissions: requests given to ``submit`` on a process other than 0.
        multimodal: the scheduler's ``MultimodalExtension`` (the first among its
            ``extensions``), or None: requests with images travel only with one.
    """

    def __init__(self, scheduler: Any, channel: Channel, *, check_agreement: bool = False) -> None:
        self.scheduler = scheduler
        self.channel = channel
        self.check_agreement = bool(check_agreement)
        self.finished: list[ServingReq] = scheduler.finished
        self.steps = 0
        self.exchange_seconds = 0.0
        self.digest_checks = 0
        self.ignored_submissions = 0
        self.multimodal: MultimodalExtension | None = next(
            (ext for ext in getattr(scheduler, "extensions", ()) if isinstance(ext, MultimodalExtension)), None
        )
        self._outbox: list[tuple[ServingReq, RequestSpec]] = []
        self._exchanged = False  # the last call was an exchange with no step since

    @property
    def process_id(self) -> int:
        return self.channel.process_id

    def submit(self, reqs: Iterable[ServingReq]) -> None:
        """On process 0: queue ``reqs`` for the next step's broadcast, all or none (the
        scheduler's ``check_servable`` first, then each one's wire form: a served request, or
        one with images the scheduler's ``MultimodalExtension`` did not make, raises
        ``ValueError`` naming it, before anything travels). Elsewhere: ignored (counted; their
        images dropped from the extension: the requests made from process 0's are served)."""
        reqs = list(reqs)
        if self.process_id != 0:
            self.ignored_submissions += len(reqs)
            if self.multimodal is not None:
                for req in reqs:
                    self.multimodal.discard(req)
            return
        self.scheduler.check_servable(reqs)
        specs = [RequestSpec.of(req, self.multimodal) for req in reqs]
        self._outbox.extend(zip(reqs, specs, strict=True))

    @property
    def idle(self) -> bool:
        """Whether every process is done: exchanges first, so process 0's new requests count."""
        self._exchange()
        return bool(self.scheduler.idle)

    def step(self) -> list[ServingReq]:
        """One scheduler step on every process; the requests that finished in it."""
        if not self._exchanged:
            self._exchange()
        self._exchanged = False
        done: list[ServingReq] = self.scheduler.step()
        self.steps += 1
        return done

    def run(self, reqs: Iterable[ServingReq] = ()) -> list[ServingReq]:
        """Submit ``reqs`` (process 0) and step until every process is idle."""
        return serve_to_completion(self, reqs)

    def leak_free(self) -> bool:
        return bool(self.scheduler.leak_free())

    def _exchange(self) -> None:
        start = time.perf_counter()
        outbox, self._outbox = self._outbox, []
        mine = StepMessage(
            self.steps,
            tuple(spec for _, spec in outbox),
            serving_digest(self.scheduler) if self.check_agreement else None,
        )
        messages = [StepMessage.decode(raw) for raw in self.channel.all_gather("step", mine.encode())]
        steps = [m.step for m in messages]
        if len(set(steps)) > 1:
            raise DivergenceError(
                self.steps, f"the processes are at different steps ({steps}); their serving loops diverged"
            )
        if self.check_agreement:
            compare_digests(self.steps, [m.digest or {} for m in messages])
            self.digest_checks += 1
        new = [req for req, _ in outbox] if self.process_id == 0 else self._build(messages[0].requests)
        if new:
            self.scheduler.submit(new)
        self._exchanged = True
        self.exchange_seconds += time.perf_counter() - start

    def _build(self, specs: Iterable[RequestSpec]) -> list[ServingReq]:
        """Process 0's new requests, made here (those with images through ``multimodal``)."""
        out = []
        for spec in specs:
            try:
                out.append(spec.build(self.multimodal))
            except ValueError as e:
                for req in out:  # all or none: the images of those made so far are dropped
                    if self.multimodal is not None:
                        self.multimodal.discard(req)
                raise DivergenceError(self.steps, str(e)) from e
        return out
