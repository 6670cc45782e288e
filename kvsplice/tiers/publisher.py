"""Publish KV events over ZeroMQ the way vLLM's `--kv-events-config` does, so its routers can listen.

Each batch goes out on a PUB socket as three frames: the topic, the batch's sequence number (8 bytes,
big-endian, from 0, one per batch) and the msgpack payload (`events.encode_batch`). The last
`buffer_steps` batches are kept; a subscriber that sees a gap in the sequence asks the ROUTER replay
socket for them: it sends [b"", start_seq (8 bytes)] and receives [b"", seq, payload] for each kept
batch from start_seq on, then [b"", -1 (8 bytes, signed), b""].

Block events and segment events never share a batch: decoders that know only vLLM's three tags
(Dynamo's) reject a whole batch with an unknown tag, and then lose only a segment batch, never a
block event. `publish` never blocks: the sockets belong to one background thread, and a batch that
finds the queue full is dropped and counted (a subscriber sees the gap in the sequence numbers).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvsplice.errors import ConfigError
from kvsplice.tiers.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# How often the thread looks at the replay socket while no batch is queued.
POLL_S = 0.02


def _opt(help_text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": help_text}, **kwargs)


@dataclass(frozen=True)
class KVEventsConfig:
    # vLLM's rule: bind when the address has a wildcard (tcp://*:5557) or is ipc:// or inproc://,
    # connect otherwise (to a subscriber that binds, as llm-d's central indexer does).
    endpoint: str = _opt("ZeroMQ address to publish KV events on, e.g. tcp://*:5557", default="tcp://*:5557")
    replay_endpoint: str | None = _opt("ZeroMQ ROUTER address for replays (None: no replay)", default=None)
    topic: str = _opt("topic frame of each message (llm-d reads kv@<pod>@<model>; vLLM's is '')", default="")
    buffer_steps: int = _opt("batches kept for replay", default=10_000)
    hwm: int = _opt(
        "PUB high-water mark: messages queued per subscriber before ZeroMQ drops", default=100_000
    )
    max_queue: int = _opt(
        "batches waiting for the publisher thread before new ones are dropped", default=100_000
    )
    data_parallel_rank: int = _opt("data-parallel rank in each event batch", default=0)

    def __post_init__(self) -> None:
        for address in (self.endpoint, self.replay_endpoint):
            if address is not None and not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"KV events endpoint {address!r} must be tcp://, ipc:// or inproc://")
        if min(self.buffer_steps, self.hwm, self.max_queue) < 1 or self.data_parallel_rank < 0:
            raise ConfigError("KV events buffer_steps, hwm and max_queue must be >= 1, the rank >= 0")

    @property
    def binds(self) -> bool:
        return (
            "*" in self.endpoint or "::" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://"))
        )


@dataclass
class PublisherStats:
    batches_published: int = 0
    batches_dropped: int = 0
    replays_served: int = 0


_BLOCK_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, context: zmq.Context | None = None) -> None:
        """Binds or connects the sockets now: a bad or busy address raises ConfigError at start-up."""
        self.config = config
        self.stats = PublisherStats()
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            if config.binds:
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as err:
            self._close_sockets()
            where = f"{config.endpoint} / {config.replay_endpoint}"
            raise ConfigError(f"KV events: cannot open {where}: {err}") from err
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(config.max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kvsplice-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue the events: block events as one batch, segment events as another. Never blocks."""
        ts = time.time()
        blocks: list[KVEvent] = [e for e in events if isinstance(e, _BLOCK_EVENTS)]
        segments: list[KVEvent] = [e for e in events if not isinstance(e, _BLOCK_EVENTS)]
        for batch in (blocks, segments):
            if not batch:
                continue
            try:
                self._queue.put_nowait((ts, batch))
            except queue.Full:
                self.stats.batches_dropped += 1

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to `timeout_s`), then close the sockets."""
        # A queue still full after timeout_s: the thread is stuck or far behind; stop without it.
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    item = self._queue.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                self._send(*item)
        finally:
            self._close_sockets()

    def _send(self, ts: float, events: list[KVEvent]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(ts, events, self.config.data_parallel_rank)
        # A PUB socket never blocks: at the high-water mark ZeroMQ drops for that subscriber.
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        self._buffer.append((seq, payload))
        self.stats.batches_published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        # Counted before the end marker goes out: a client that has the whole replay sees it counted
        # (counted after, the suite read 0 once under load).
        self.stats.replays_served += 1
        self._replay.send_multipart([client, b"", END_SEQ, b""])

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
