"""The engine's own thread, and how asyncio handlers reach it.

The Engine is single-threaded: one thread owns it and does everything to it (add, step, abort). A
handler puts commands on a thread-safe queue and gets a `RequestGroup`: the asyncio queue on which
the engine thread delivers that HTTP request's StepOutputs (one engine request per prompt of it).

    loop:  take every queued command (block only when the engine is idle)
           step the engine; hand each output to its group's asyncio queue; snapshot the stats
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvsplice.engine.engine import Engine, StepOutput
from kvsplice.engine.stats import EngineStats
from kvsplice.options import RequestOptions
from kvsplice.prompt import Prompt
from kvsplice.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineUnavailableError(Exception):
    """The engine thread has stopped (shutdown), or the engine is broken."""


class EngineFailure(Exception):
    """The engine raised while running this request (a bug): the request is lost, the server lives on."""


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    options: RequestOptions
    group: RequestGroup
    index: int
    done: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_id: str


_STOP = object()
Item = tuple[int, StepOutput | Exception]


class RequestGroup:
    """The engine requests of one HTTP request, and the queue their outputs arrive on, as (index, item)."""

    def __init__(self, engine: AsyncEngine, base_id: str, size: int) -> None:
        self._engine = engine
        self.request_ids = [base_id if size == 1 else f"{base_id}-{i}" for i in range(size)]
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.finished: set[int] = set()

    def put(self, index: int, item: StepOutput | Exception) -> None:
        """Called from the engine thread."""
        # A closed event loop (RuntimeError) has nobody listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, item))

    async def __aiter__(self) -> AsyncIterator[tuple[int, StepOutput]]:
        """Every output until all requests finish; raises EngineFailure if the engine failed them."""
        while len(self.finished) < len(self.request_ids):
            index, item = await self.queue.get()
            if isinstance(item, Exception):
                self.finished.update(range(len(self.request_ids)))
                raise item
            if item.output is not None:
                self.finished.add(index)
            yield index, item

    def abort_unfinished(self) -> None:
        """Cancel what has not finished (the client went away); its KV blocks are freed at once."""
        for index, request_id in enumerate(self.request_ids):
            if index not in self.finished:
                self._engine.abort(request_id)
        self.finished.update(range(len(self.request_ids)))


class AsyncEngine:
    """Runs an Engine in its own thread; safe to call from any thread or event loop."""

    def __init__(
        self,
        engine: Engine,
        on_output: Callable[[StepOutput], None] | None = None,
        on_abort: Callable[[str], None] | None = None,
    ) -> None:
        """on_output sees every engine output, on_abort every request cancelled unfinished (both are
        called on the engine thread)."""
        self.engine = engine
        self._on_output = on_output
        self._on_abort = on_abort
        self._commands: queue.SimpleQueue[object] = queue.SimpleQueue()
        # Owned by the engine thread: the group of every request in the engine.
        self._groups: dict[str, tuple[RequestGroup, int]] = {}
        self._thread = threading.Thread(target=self._run, name="kvsplice-engine", daemon=True)
        self._stopping = False
        self.broken: str | None = None  # why the engine cannot serve any more, once it cannot
        self.stats = EngineStats()
        self._snapshot()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.broken is None and not self._stopping

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish the thread; requests still in flight fail with EngineUnavailableError."""
        if self._thread.is_alive():
            self._stopping = True
            self._commands.put(_STOP)
            self._thread.join()

    # -- called from handlers ---------------------------------------------------------------------

    async def submit(
        self, base_id: str, prompts: list[Prompt], params: SamplingParams, options: RequestOptions
    ) -> RequestGroup:
        """Add one engine request per prompt; raises what Engine.add_request raises (bad input),
        QueueFullError or EngineUnavailableError, with none of the group's requests left behind."""
        group = RequestGroup(self, base_id, len(prompts))
        try:
            for index, (request_id, prompt) in enumerate(zip(group.request_ids, prompts, strict=True)):
                if not self.healthy:
                    raise EngineUnavailableError(self.broken or "the engine is shutting down")
                done: concurrent.futures.Future[None] = concurrent.futures.Future()
                self._commands.put(_Add(request_id, prompt, params, options, group, index, done))
                await asyncio.wrap_future(done)
        except BaseException:  # bad input, a full queue, or the client went away while waiting
            group.abort_unfinished()
            raise
        return group

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if not self._iterate():
                    return
            except Exception as exc:
                # A bug outside engine.step (those are caught there): never let the thread die with
                # handlers waiting on it; refuse new work instead.
                logger.exception("the engine loop failed; the engine is marked broken")
                self.broken = f"the engine loop failed and must be restarted: {exc!r}"
                self._fail_all(EngineFailure(self.broken))

    def _iterate(self) -> bool:
        """Take the queued commands, then run one step; False once told to stop."""
        # Wait for a command unless there is a step to run (a broken engine runs none).
        idle = self.broken is not None or not self.engine.has_unfinished()
        try:
            command = self._commands.get(block=idle)
        except queue.Empty:
            command = None
        while command is not None:
            if command is _STOP:
                self._fail_all(EngineUnavailableError("the server is shutting down"))
                return False
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        if self.broken is None and self.engine.has_unfinished():
            self._step()
        self._snapshot()
        return True

    def _handle(self, command: object) -> None:
        if isinstance(command, _Abort):
            if self._groups.pop(command.request_id, None) is not None:
                self._guarded(lambda: self.engine.abort(command.request_id))
                self._notify(self._on_abort, command.request_id)
            return
        assert isinstance(command, _Add)
        if not command.done.set_running_or_notify_cancel():
            return  # the handler gave up waiting (its client went away)
        try:
            if self.broken is not None:
                raise EngineUnavailableError(self.broken)
            self.engine.add_request(
                command.prompt, command.params, command.options, request_id=command.request_id
            )
        except Exception as exc:  # bad input (InvalidRequestError), a full queue, or an engine bug
            command.done.set_exception(exc)
            return
        self._groups[command.request_id] = (command.group, command.index)
        command.done.set_result(None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # A bug in the engine: which request caused it is unknown, so every request in flight fails.
            logger.exception("engine step failed; failing the %d requests in flight", len(self._groups))
            self._fail_all(EngineFailure(f"the engine failed while running this request: {exc!r}"))
            return
        for out in outputs:
            self._notify(self._on_output, out)
            entry = self._groups.get(out.request_id)
            if entry is None:
                continue
            group, index = entry
            group.put(index, out)
            if out.output is not None:
                del self._groups[out.request_id]

    def _fail_all(self, error: Exception) -> None:
        for request_id, (group, index) in list(self._groups.items()):
            self._guarded(lambda request_id=request_id: self.engine.abort(request_id))  # type: ignore[misc]
            group.put(index, error)
        self._groups.clear()

    def _notify(self, callback: Callable[[Any], None] | None, value: object) -> None:
        if callback is not None:
            try:
                callback(value)
            except Exception:
                logger.exception("an engine observer failed")

    def _guarded(self, action: Callable[[], object]) -> None:
        try:
            action()
        except Exception as exc:
            # The engine's state is no longer trustworthy: refuse new work rather than corrupt it further.
            logger.exception("the engine failed to clean up; it is marked broken")
            self.broken = f"the engine is broken and must be restarted: {exc!r}"

    def _snapshot(self) -> None:
        self.stats = self.engine.stats()
