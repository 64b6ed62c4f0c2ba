"""Sequences: correlated requests of one stream, with the stream's state kept in the server.

A runner that declares ``[runner.sequence]`` serves sequences as Triton's sequence
batcher does. Each request names its sequence with the request parameters Triton's
clients send: ``sequence_id`` (a non-zero integer or a non-empty string),
``sequence_start`` on its first request and ``sequence_end`` on its last. The state
each ``[[runner.sequence.state]]`` declares starts at its ``initial`` value, reaches
the runner as an input with each request, and is replaced by the runner's matching
output, which the client never sees: it sends only its data. A state declared with
``from_input`` is a context instead: the last samples of a request input, kept for the
sequence's next request and fed in front of its samples or as an input of its own
(``SequenceTensors.contexts_of``, ``scheduling/sequence_tensors.py``), as a streaming
model's own wrapper keeps them.

A sequence's requests run one at a time, in the order they arrive; requests of
different sequences batch together (each state is one row of its batch). A request
waiting for its sequence's turn counts against the runner's ``max_queue_size`` as a
queued one does (429 past it). A sequence ends with its ``sequence_end`` request or
after ``idle_timeout_s`` without one, and its state is dropped; what watches the
sequences (:meth:`SequenceHolder.watch`) hears of each end, so that nothing of an ended
sequence is kept.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import numpy as np

from plugserve.registry.errors import InvalidInput, PluginLoadError, TooManyRequests
from plugserve.registry.execution.layout import BatchLayout, TensorBounds
from plugserve.registry.execution.scheduling.sequence_tensors import SequenceTensors
from plugserve.registry.manifest import BatchingSection, ContextSpec, SequenceSection

Arrays = Mapping[str, np.ndarray]
SequenceId = int | str
Ended = Callable[[SequenceId], None]
"""Told the id of a sequence that no longer runs where it ran."""

MAX_ID_CHARS = 256
SWEEP_SLACK_S = 0.01
"""A sweep timer fires this long after the expiry it waits for (clocks and timers differ)."""


SEQUENCE_FIELDS = ("sequence_id", "sequence_start", "sequence_end")
"""The request parameters that place a request in its sequence."""


def is_sequence_id(value: Any) -> bool:
    """Whether ``value`` is a sequence id a runner takes: an integer in 1..2**64-1, or a
    string of 1 to :data:`MAX_ID_CHARS` characters (:func:`sequence_of` says why not)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return 0 < value < 2**64
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS


def sequence_of(parameters: Mapping[str, Any]) -> tuple[SequenceId | None, bool, bool]:
    """A request's ``sequence_id`` (``None`` when absent or 0, as Triton reads it),
    ``sequence_start`` and ``sequence_end``; a 400 for values of the wrong type."""
    raw = parameters.get("sequence_id")
    start, end = parameters.get("sequence_start", False), parameters.get("sequence_end", False)
    if not isinstance(start, bool) or not isinstance(end, bool):
        raise InvalidInput("sequence_start and sequence_end must be true or false")
    if raw is None or raw == 0 or raw == "":
        return None, start, end
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise InvalidInput("sequence_id must be an integer or a string")
    if isinstance(raw, str) and len(raw) > MAX_ID_CHARS:
        raise InvalidInput(f"a sequence_id of at most {MAX_ID_CHARS} characters")
    if isinstance(raw, int) and not 0 < raw < 2**64:
        raise InvalidInput("sequence_id must be an integer in 1..2**64-1 or a string")
    return raw, start, end


class Sequence:
    """One live sequence: its state and contexts, when it was last used, and its turn."""

    __slots__ = ("context", "ended", "last", "state", "turn", "users")

    def __init__(
        self, state: dict[str, np.ndarray], context: dict[str, np.ndarray], now: float
    ) -> None:
        self.state = state
        self.context = context
        """Each context (``from_input``) by the model input it is fed as."""
        self.last = now
        self.turn = asyncio.Lock()  # waiters are woken in the order they came
        self.users = 0
        """Requests running or waiting for their turn: the sequence is not idle."""
        self.ended = False


class QueueRoom(Protocol):
    """The runner's queue (its ``Scheduler``), as far as a request waiting for its
    sequence's turn asks it."""

    def check_room(self) -> None:
        """429 when ``max_queue_size`` requests wait already."""
        ...


class Sequences:
    """The live sequences of one runner version, and how a request of one runs."""

    def __init__(
        self,
        section: SequenceSection,
        label: str,
        layout: BatchLayout | None = None,
        clock: Callable[[], float] = time.monotonic,
        queue: QueueRoom | None = None,
    ) -> None:
        self.section = section
        self._controls = section.controls.names
        self.layout = layout
        """The runner's declared batching: the axis each state's row is on (default 0)."""
        self.label = label
        self.clock = clock
        self.queue = queue
        """The runner's queue, whose ``max_queue_size`` bounds the requests waiting for
        their turn too."""
        self.tensors = SequenceTensors(section, label, layout)
        """Its sequences' state, context and control tensors."""
        self.waiting = 0
        """Requests waiting for their sequence's turn (its requests before them run)."""
        self._live: dict[SequenceId, Sequence] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._watchers: list[Ended] = []
        self.started = 0
        self.ended = 0
        self.expired = 0

    @property
    def live(self) -> int:
        return len(self._live)

    @property
    def bounds(self) -> TensorBounds:
        """What one tensor may hold (the server's): a chunk joined with its context too."""
        return self.tensors.bounds

    @bounds.setter
    def bounds(self, bounds: TensorBounds) -> None:
        self.tensors.bounds = bounds

    def holds(self, sequence_id: Any) -> bool:
        """Whether ``sequence_id`` is running here (an unhashable id never is)."""
        try:
            return sequence_id in self._live
        except TypeError:
            return False

    def watch(self, ended: Ended) -> None:
        """Call ``ended(sequence_id)`` each time a sequence stops running here: its end,
        its expiry, a start that failed, the runner's release (once per ``ended``)."""
        if ended not in self._watchers:
            self._watchers.append(ended)

    async def wait_ended(self, within: float) -> bool:
        """Wait until no sequence runs here (each ends, or expires after its idle timeout);
        ``False`` if ``within`` seconds pass first."""
        deadline = self.clock() + within
        while self._live:
            if self.clock() >= deadline:
                return False
            await asyncio.sleep(min(0.05, self.section.idle_timeout_s))
            self.sweep()  # an expiry here need not wait for the timer's next round
        return True

    def describe(self) -> dict[str, Any]:
        self.sweep()
        return {
            "live": len(self._live),
            "max_sequences": self.section.max_sequences,
            "started": self.started,
            "ended": self.ended,
            "expired": self.expired,
        }

    async def run(
        self,
        inputs: Arrays,
        parameters: Mapping[str, Any],
        execute: Callable[[Arrays], Awaitable[Arrays]],
    ) -> Arrays:
        """Run one request of its sequence: in its turn, with the sequence's state and
        contexts as inputs; the state outputs and the new contexts are kept, the rest
        answered."""
        sequence_id, start, end = sequence_of(parameters)
        if sequence_id is None:
            raise InvalidInput(
                f"runner {self.label} serves sequences: each request names its sequence "
                "(the sequence_id parameter, a non-zero integer or a non-empty string)"
            )
        if (_rows(inputs) if self.layout is None else self.layout.rows(inputs)) != 1:
            raise InvalidInput(f"a request of a sequence holds one row (runner {self.label})")
        while True:
            sequence, fresh = self._sequence_for(sequence_id, start)
            sequence.users += 1
            try:
                await self._turn(sequence)
                try:
                    if sequence.ended:  # ended while this request waited for its turn
                        if start or sequence_id in self._live:
                            # A start begins it again; a request queued behind that start
                            # goes on in the sequence it began, after it.
                            continue
                        raise InvalidInput(f"sequence {sequence_id!r} of runner {self.label} ended")
                    # Started again, as Triton does: from the initial state; kept only once
                    # the request succeeds (a failed request leaves the state as it was).
                    restart = start and not fresh
                    tensors = self.tensors
                    state = tensors.initial() if restart else sequence.state
                    context = after = tensors.initial_contexts() if restart else sequence.context
                    try:
                        fed = {**inputs, **state}
                        if context:
                            joined, after = await tensors.contexts(inputs, context)
                            fed.update(joined)
                        if self._controls:
                            fed.update(tensors.controls(sequence_id, start, end))
                        kept, answer = tensors.kept(await execute(fed))
                    except BaseException:
                        if fresh:  # a start that failed started nothing
                            self._end(sequence_id, sequence)
                            self.started -= 1
                        raise
                    sequence.state, sequence.context = kept, after
                    if end:
                        self._end(sequence_id, sequence)
                        self.ended += 1
                finally:
                    sequence.turn.release()
            finally:
                sequence.users -= 1
                sequence.last = self.clock()
                self._arm()
            return answer

    async def _turn(self, sequence: Sequence) -> None:
        """Wait for ``sequence``'s turn, counted in :attr:`waiting` while its requests
        before this one run: 429 when the runner's queue has no room for one more."""
        if sequence.users == 1:  # none before it: its turn at once
            await sequence.turn.acquire()
            return
        if self.queue is not None:
            self.queue.check_room()
        self.waiting += 1
        try:
            await sequence.turn.acquire()
        finally:
            self.waiting -= 1

    def _sequence_for(self, sequence_id: SequenceId, start: bool) -> tuple[Sequence, bool]:
        """The live sequence ``sequence_id`` (a start makes it when there is none), and
        whether it was made now; 400 when it does not run, 429 past ``max_sequences``."""
        sequence = self._live.get(sequence_id)
        if sequence is not None and self._idle(sequence, self.clock()):
            # Expired, and not yet swept; a start goes on under the same id at once.
            self._end(sequence_id, sequence, told=not start)
            self.expired += 1
            sequence = None
        if sequence is not None:
            return sequence, False
        if not start:
            raise InvalidInput(
                f"sequence {sequence_id!r} of runner {self.label} is not running: its "
                "first request sets sequence_start (or it ended, or it was idle for "
                f"over {self.section.idle_timeout_s:g} s)"
            )
        if len(self._live) >= self.section.max_sequences:
            self.sweep()  # room held by sequences that have expired meanwhile
        if len(self._live) >= self.section.max_sequences:
            raise TooManyRequests(
                f"runner {self.label} has {len(self._live)} sequences running, its "
                "max_sequences: end one first",
                retry_after_s=1,
            )
        sequence = Sequence(self.tensors.initial(), self.tensors.initial_contexts(), self.clock())
        self._live[sequence_id] = sequence
        self.started += 1
        return sequence, True

    def _arm(self, delay: float | None = None) -> None:
        """Sweep again once the idle timeout has passed, while sequences are alive, so that
        an idle runner frees their state without a request to trigger it."""
        if self._timer is None and self._live:
            self._timer = asyncio.get_running_loop().call_later(
                self.section.idle_timeout_s if delay is None else delay, self._on_timer
            )

    def _on_timer(self) -> None:
        self._timer = None
        soonest = self.sweep()
        if soonest is not None:  # the next sequence to expire, when it does (a tick late)
            self._arm(max(soonest - self.clock(), 0.0) + SWEEP_SLACK_S)

    def _end(self, sequence_id: SequenceId, sequence: Sequence, told: bool = True) -> None:
        """``sequence`` no longer runs; its watchers are told unless ``told`` is false."""
        sequence.ended = True
        if self._live.get(sequence_id) is sequence:
            del self._live[sequence_id]
            if told:
                _tell(self._watchers, sequence_id)

    def _idle(self, sequence: Sequence, now: float) -> bool:
        return not sequence.users and now - sequence.last > self.section.idle_timeout_s

    def sweep(self) -> float | None:
        """End the sequences idle for over ``idle_timeout_s``: on a timer while sequences
        run (:meth:`_arm`), when a start finds no room and when the figures are read; a
        request finds its own sequence expired without a sweep. Returns when the next
        live sequence expires, if nothing uses it meanwhile (``None``: none is left)."""
        now = self.clock()
        idle_s = self.section.idle_timeout_s
        soonest: float | None = None
        for sequence_id, sequence in list(self._live.items()):
            if self._idle(sequence, now):
                self._end(sequence_id, sequence)
                self.expired += 1
                continue
            expiry = now + idle_s if sequence.users else sequence.last + idle_s
            soonest = expiry if soonest is None else min(soonest, expiry)
        return soonest

    def clear(self) -> None:
        """Drop every sequence (the runner is released)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        live, self._live = self._live, {}
        for sequence_id, sequence in live.items():
            sequence.ended = True
            _tell(self._watchers, sequence_id)


def _tell(watchers: list[Ended], sequence_id: SequenceId) -> None:
    for ended in watchers:
        ended(sequence_id)


def inputs_as_sent(
    section: SequenceSection, batching: BatchingSection | None, inputs: list[Any], label: str
) -> list[Any]:
    """A model's declared inputs (``metadata()["inputs"]``) as a request of a sequence sends
    them: a prepended context's input holds the request's chunk, fewer samples than the
    model takes by the context's (a fixed size; ``-1``, any size, stays so).

    Raises :class:`PluginLoadError` where the model's input cannot take its declared
    context: another datatype, another rank, or no room left for a chunk.
    """
    prepended = {spec.input: spec for spec in section.contexts if spec.prepended}
    shown = []
    for tensor in inputs:
        name = tensor.get("name") if isinstance(tensor, Mapping) else None
        spec = prepended.get(name) if isinstance(name, str) else None
        if spec is None:
            shown.append(tensor)
            continue
        shown.append({**tensor, "shape": _chunk_shape(spec, batching, tensor, label)})
    return shown


def _chunk_shape(
    spec: ContextSpec, batching: BatchingSection | None, tensor: Mapping[str, Any], label: str
) -> Any:
    row_axis = 0 if batching is None else batching.input(spec.source).axis
    datatype, shape = tensor.get("datatype"), tensor.get("shape")
    where = f"{label}: input {spec.source!r} keeps a context ([[runner.sequence.state]])"
    if isinstance(datatype, str) and datatype != spec.datatype:
        raise PluginLoadError(f"{where} of {spec.datatype}; the model takes {datatype}")
    if not isinstance(shape, list | tuple):
        return shape
    if len(shape) != len(spec.shape) + 1:
        raise PluginLoadError(
            f"{where} of {len(spec.shape)} dimensions and a batch axis; the model's input "
            f"has shape {list(shape)}"
        )
    size, length = shape[spec.axis], spec.length(row_axis)
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return list(shape)
    if size <= length:
        raise PluginLoadError(
            f"{where} of {length} samples on axis {spec.axis}; the model takes {size} there, "
            "leaving no room for the request's own"
        )
    return [size - length if axis == spec.axis else d for axis, d in enumerate(shape)]


def _rows(inputs: Arrays) -> int:
    for array in inputs.values():
        return int(array.shape[0]) if array.ndim else 1
    return 1


class SequenceHolder(Protocol):
    """What keeps a runner's sequences, as a request's placement and shadow traffic ask it."""

    section: SequenceSection
    """The runner's ``[runner.sequence]``: its ``max_sequences`` and ``idle_timeout_s``."""

    @property
    def live(self) -> int:
        """The sequences running here."""
        ...

    def holds(self, sequence_id: Any) -> bool:
        """Whether ``sequence_id`` runs here."""
        ...

    def watch(self, ended: Ended) -> None:
        """Call ``ended(sequence_id)`` each time a sequence stops running here."""
        ...


class SeenSequences:
    """The sequences a worker's requests have running in a runner process
    (``isolation = "process"``): started and not yet ended, expired or refused, as the
    worker saw them. It pins them to their runner version (``server/dataplane/pins.py``)
    and holds a reload's old processes until they end, as :class:`Sequences` does for a
    runner in the worker. A sequence whose requests all go through one worker (one
    connection, as a streaming client's do) is seen whole. Its watchers hear of each
    sequence it stops seeing: ended, refused, idle past its timeout (on a timer), or
    its runner released (:meth:`clear`)."""

    def __init__(self, section: SequenceSection, clock: Callable[[], float] = time.monotonic):
        self.section = section
        self.clock = clock
        self._last: dict[SequenceId, float] = {}
        self._watchers: list[Ended] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def live(self) -> int:
        self._forget_idle()
        return len(self._last)

    def holds(self, sequence_id: Any) -> bool:
        try:
            last = self._last.get(sequence_id)
        except TypeError:  # an unhashable id is never one
            return False
        return last is not None and self.clock() - last <= self.section.idle_timeout_s

    def watch(self, ended: Ended) -> None:
        """As :meth:`Sequences.watch`."""
        if ended not in self._watchers:
            self._watchers.append(ended)

    def clear(self) -> None:
        """Forget every sequence (the runner is released)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        seen, self._last = self._last, {}
        for sequence_id in seen:
            _tell(self._watchers, sequence_id)

    def answered(self, parameters: Mapping[str, Any] | None, status: int) -> None:
        """A request of a sequence was answered with ``status``: what it tells of its
        sequence. A failed start leaves none running, an answered end ends it; a step that
        failed or was refused (its input, 4xx) leaves it as it was, as the runner does: one
        the runner no longer has (ended, expired) is forgotten here at its idle timeout."""
        if not parameters:
            return
        try:
            sequence_id, start, end = sequence_of(parameters)
        except InvalidInput:
            return
        if sequence_id is None:
            return
        if status != 200 and not start:
            return
        if status != 200 or end:
            if self._last.pop(sequence_id, None) is not None:
                _tell(self._watchers, sequence_id)
        elif start or sequence_id in self._last:
            self._last[sequence_id] = self.clock()
            if len(self._last) > self.section.max_sequences:
                self._forget_idle()
            self._arm()

    async def wait_ended(self, within: float) -> bool:
        """Wait until no sequence seen here runs (each ends or goes idle past its timeout);
        ``False`` if ``within`` seconds pass first."""
        deadline = self.clock() + within
        while self.live:
            if self.clock() >= deadline:
                return False
            await asyncio.sleep(min(0.05, self.section.idle_timeout_s))
        return True

    def _arm(self) -> None:
        """Forget the idle sequences once the idle timeout has passed, while some are seen."""
        if self._timer is None and self._last:
            self._timer = asyncio.get_running_loop().call_later(
                self.section.idle_timeout_s + SWEEP_SLACK_S, self._on_timer
            )

    def _on_timer(self) -> None:
        self._timer = None
        self._forget_idle()
        if self._last:  # the next to go idle, a tick after it does
            soonest = min(self._last.values()) + self.section.idle_timeout_s
            self._timer = asyncio.get_running_loop().call_later(
                max(soonest - self.clock(), 0.0) + SWEEP_SLACK_S, self._on_timer
            )

    def _forget_idle(self) -> None:
        now, idle_s = self.clock(), self.section.idle_timeout_s
        for sequence_id, last in list(self._last.items()):
            if now - last > idle_s:
                del self._last[sequence_id]
                _tell(self._watchers, sequence_id)
