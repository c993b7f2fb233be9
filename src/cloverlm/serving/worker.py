"""The engine worker: one thread owns the `Engine` and steps it while there is work, so requests from all
clients share each batched forward (continuous batching). HTTP handlers hand it jobs through a
thread-safe queue and get blocks and completions back as events on the job's asyncio queue.

Every job ends: the engine bounds a request's forwards (max_tokens, max_steps, the slots of a
decision), and before each forward the worker ends the jobs past their deadline (the server's
per-request time limit): finish_reason "time_limit" with what they produced, or 429 for a job that
never got a batch slot.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cloverlm.decoding.engine import Engine
from cloverlm.decoding.params import Completion, Request
from cloverlm.errors import CloverError

log = logging.getLogger(__name__)


# -- what the worker sends back --


@dataclass
class BlockEvent:
    index: int
    tokens: list[int]


@dataclass
class DoneEvent:
    index: int
    completion: Completion


@dataclass
class FailedEvent:
    status: int
    message: str
    code: str | None = "engine_error"


class Job:
    """One HTTP request in flight: its engine requests (one per choice), the queue their events reach, and
    its deadline (`timeout_s` from now)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float = float("inf")):
        self.loop = loop
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.events: asyncio.Queue = asyncio.Queue()
        self.requests: list[Request] = []
        self.running: set[int] = set()  # worker side: choices not finished yet

    def post(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass


# -- metrics --


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("clover_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("clover_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.generated_tokens = Counter("clover_generated_tokens", "Tokens generated", registry=r)
        self.forwards = Counter("clover_forwards", "Batched decoding forwards", registry=r)
        self.cancelled = Counter("clover_cancelled", "Generations dropped before their end (client gone, or a decoding failure)", registry=r)
        self.timed_out = Counter("clover_timed_out", "Generations ended by the server's per-request time limit", registry=r)
        self.latency = Histogram(
            "clover_request_latency_seconds", "Time from request to last token", ["endpoint"], registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.waiting = Gauge("clover_queue_size", "Generations waiting for a batch slot", registry=r)
        self.running = Gauge("clover_running", "Generations in the batch", registry=r)


# -- the engine worker --


_STOP = object()


class EngineWorker:
    """Owns the engine: one thread steps it while there is work; other threads only enqueue commands."""

    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: set[Job] = set()
        # Generations reserved and not yet finished or cancelled. Counted here, where they end, so that a
        # stream the client dropped before it started still frees its share when it finishes.
        self._load = 0
        self._load_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="clover-engine", daemon=True)
        metrics.waiting.set_function(lambda: len(self.engine.waiting))
        metrics.running.set_function(lambda: len(self.engine.rows))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=30)

    def reserve(self, count: int, limit: int) -> bool:
        """Take `count` generations of the `limit` in flight; False (nothing taken) if they do not fit."""
        with self._load_lock:
            if self._load + count > limit:
                return False
            self._load += count
            return True

    def _release(self, count: int) -> None:
        with self._load_lock:
            self._load -= count

    def submit(self, job: Job) -> None:
        """Queue a job whose generations were reserved."""
        self._commands.put(lambda: self._submit(job))

    def cancel(self, job: Job) -> None:
        self._commands.put(lambda: self._cancel(job))

    def _run(self) -> None:
        while True:
            command = self._next(block=not self.engine.has_work())
            while command is not None:
                if command is _STOP:
                    return
                command()
                command = self._next(block=False)
            if self.engine.has_work():
                self._expire(time.monotonic())
            if self.engine.has_work():
                self._step()

    def _next(self, block: bool):
        try:
            return self._commands.get(block=block)
        except queue.Empty:
            return None

    def _submit(self, job: Job) -> None:
        for index, request in enumerate(job.requests):
            try:
                self.engine.submit(request)
            except CloverError as error:  # checked before, so this is a gap in those checks: still the input's
                self._release(len(job.requests) - len(job.running))
                self._cancel(job)
                job.post(FailedEvent(400, str(error)))
                return
            job.running.add(index)
            self._jobs.add(job)

    def _cancel(self, job: Job) -> None:
        if job not in self._jobs:
            return
        for index in job.running:
            self.engine.cancel(job.requests[index])
        self.metrics.cancelled.inc(len(job.running))
        self._release(len(job.running))
        job.running.clear()
        self._jobs.discard(job)

    def _expire(self, now: float) -> None:
        """End the jobs past their deadline: each open choice with what it has produced, finish_reason
        "time_limit"; a job none of whose choices got a batch slot answers 429 instead."""
        for job in [job for job in self._jobs if job.deadline <= now]:
            ended = {index: self.engine.end(job.requests[index], "time_limit") for index in sorted(job.running)}
            self.metrics.timed_out.inc(len(ended))
            self._release(len(ended))
            job.running.clear()
            self._jobs.discard(job)
            if len(ended) == len(job.requests) and all(c is None or not c.forwards for c in ended.values()):
                job.post(FailedEvent(429, f"no batch slot came free within the server's time limit of {job.timeout_s:g} s; "
                                          "retry later", "server_busy"))
                continue
            for index, completion in ended.items():
                request = job.requests[index]  # (None: not in the engine, which a running choice always is)
                job.post(DoneEvent(index, completion or Completion(request.request_id, [], "time_limit", len(request.prompt_ids), 0, 0, 0)))

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception:  # a bug, not bad input: fail what is in flight, keep serving
            log.exception("decoding step failed; failing the requests in flight")
            for job in list(self._jobs):
                self._cancel(job)
                job.post(FailedEvent(500, "internal error while decoding"))
            return
        self.metrics.forwards.inc()
        for completion in finished:
            job, index = completion.request_id
            job.running.discard(index)
            self._release(1)
            if not job.running:
                self._jobs.discard(job)
            self.metrics.generated_tokens.inc(len(completion.tokens))
            self.metrics.prompt_tokens.inc(completion.prompt_tokens)
            job.post(DoneEvent(index, completion))
