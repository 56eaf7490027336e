"""KV cache events in vLLM's wire format: `--kv-events-config`, the msgpack encoding and a
ZMQ PUB publisher (with vLLM's replay ROUTER), so routers that read vLLM's events (llm-d's
KV-cache indexer, Dynamo's router) read a pdserve engine's.

    monitor tick ──publish(events)──▶ bounded queue ──▶ publisher thread ──▶ PUB socket
    (event loop, never blocks;        (full: batch       encodes, numbers,   (topic, seq, payload)
     a full queue drops, counted)      dropped)          keeps a ring  ───▶ ROUTER (replay)

Wire format (vLLM 0.32, vllm/distributed/kv_events.py), one multipart message per batch:

    frame 0   topic, UTF-8 (config `topic`, default empty)
    frame 1   sequence number, 8 bytes big-endian, 0, 1, 2, ... per publisher
    frame 2   msgpack of KVEventBatch, an array: [ts (float64 seconds since the epoch),
              [event, ...], data_parallel_rank (int)]; each event is a map whose first key
              "type" names it (msgspec's tagged struct), then its fields in vLLM's order:
                {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
                 "token_ids": [int, ...], "block_size": int, "lora_id": int | nil,
                 "medium": "GPU" | "STORAGE", "lora_name": str | nil}
                {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": str}
                {"type": "AllBlocksCleared"}

A hash `h` is an int, the low 64 bits of the block hash read big-endian (vLLM's default,
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), or with that variable set to 0 the 16 hash bytes.
Replay: a DEALER/REQ client sends the first sequence number it wants (8 bytes big-endian)
to `replay_endpoint`; the publisher answers every buffered batch from it, as
(b"", topic, seq, payload) frames, then (b"", b"", seq -1, b"").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import zmq

from pdserve.shared.kv_cache.block_pool import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame that ends a replay answer."""
INT_BLOCK_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
"""vLLM's variable, read as vLLM does ("0": hashes as bytes; default and else: ints)."""


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` (vllm/config/kv_events.py): the same keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    """"zmq" publishes, "null" drops; None: "zmq" when events are enabled, else "null"."""
    endpoint: str = "tcp://*:5557"
    """The PUB socket: a wildcard (`*`), ipc:// or inproc:// address is bound, any other
    tcp:// address is connected to (a collector that binds)."""
    replay_endpoint: str | None = None
    """The ROUTER socket answering replay requests (bound); None: no replay."""
    buffer_steps: int = 10_000
    """Batches kept for replay (the newest)."""
    hwm: int = 100_000
    """The PUB socket's send high-water mark, in messages (past it ZMQ drops)."""
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread, at most (past it they are dropped)."""
    topic: str = ""

    @classmethod
    def from_value(cls, value: str | Mapping[str, Any] | None) -> KVEventsConfig | None:
        """Parse `--kv-events-config` (a JSON object, or a dict); None stays None.

        Raises:
            ValueError: one line naming the bad JSON, key or value.
        """
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--kv-events-config is not valid JSON: {e}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"--kv-events-config must be a JSON object, got {value!r}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; known: "
                             f"{sorted(fields)}")
        for key, v in value.items():
            _check_value(key, v)
        config = cls(**value)
        if config.publisher is None:
            config = dataclasses.replace(
                config, publisher="zmq" if config.enable_kv_cache_events else "null")
        return config

    @property
    def is_publishing(self) -> bool:
        """Events are on and go out over ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def _check_value(key: str, v: Any) -> None:
    ok = {"enable_kv_cache_events": isinstance(v, bool),
          "publisher": v in ("null", "zmq", None),
          "endpoint": isinstance(v, str) and v != "",
          "replay_endpoint": v is None or isinstance(v, str) and v != "",
          "topic": isinstance(v, str)}.get(key)
    if ok is None:  # the counts: 0 is "no limit" for ZMQ's hwm, no replay for buffer_steps
        ok = isinstance(v, int) and not isinstance(v, bool) \
            and v >= (1 if key == "max_queue_size" else 0)
    if not ok:
        raise ValueError(f"--kv-events-config: bad value for {key!r}: {v!r}")


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """`endpoint` for the `rank`-th engine on a host, as vLLM offsets per data-parallel
    rank: tcp port + rank (port 0 stays 0: the OS picks), ipc / inproc name + `_dp{rank}`.

    Raises:
        ValueError: an endpoint that is neither tcp, ipc nor inproc.
    """
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    if endpoint.startswith("tcp://") and port.isdigit() and base != "tcp":
        return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"
    raise ValueError(f"--kv-events-config: cannot offset endpoint {endpoint!r} (tcp://host:"
                     "port, ipc:// or inproc://)")


# -- encoding -----------------------------------------------------------------------------

def external_block_hash(block_hash: bytes, int_hashes: bool) -> bytes | int:
    """vLLM's `maybe_convert_block_hash`: the low 64 bits read big-endian, or the bytes."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF if int_hashes \
        else bytes(block_hash)


def event_to_wire(event: KVCacheEvent, int_hashes: bool = True) -> dict[str, Any]:
    """One internal event as vLLM's tagged map (key order as msgspec writes it)."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return {"type": "BlockStored",
                "block_hashes": [external_block_hash(h, int_hashes) for h in event.block_hashes],
                "parent_block_hash": None if parent is None
                else external_block_hash(parent, int_hashes),
                "token_ids": list(event.token_ids), "block_size": event.block_size,
                "lora_id": event.lora_id, "medium": event.medium, "lora_name": event.lora_name}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved",
                "block_hashes": [external_block_hash(h, int_hashes) for h in event.block_hashes],
                "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(ts: float, events: Sequence[KVCacheEvent], data_parallel_rank: int = 0,
                 int_hashes: bool = True) -> bytes:
    """The msgpack payload of vLLM's `KVEventBatch(ts, events, data_parallel_rank)`."""
    return msgpack.packb([float(ts), [event_to_wire(e, int_hashes) for e in events],
                          data_parallel_rank], use_bin_type=True)


def use_int_block_hashes(environ: Mapping[str, str] = os.environ) -> bool:
    """vLLM's default (ints) unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is 0."""
    return bool(int(environ.get(INT_BLOCK_HASHES_ENV, "1")))


# -- the publisher ------------------------------------------------------------------------

class KVEventPublisher:
    """Publishes event batches on a ZMQ PUB socket from a thread of its own.

    Binds (or connects) in the constructor, so a bad or busy endpoint fails the start;
    from then on only the thread touches the sockets. `publish` never blocks.

    Raises (constructor):
        zmq.ZMQError: the endpoint cannot be bound or connected.
    """

    SHUTDOWN_TIMEOUT = 2.0
    """Seconds `shutdown` lets the thread send what is queued (and the socket flush)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0,
                 int_hashes: bool | None = None) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.int_hashes = use_int_block_hashes() if int_hashes is None else int_hashes
        self.num_published = 0
        """Batches sent so far (the next sequence number)."""
        self.num_dropped = 0
        """Batches dropped because the queue was full."""
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = \
            queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self.endpoint = _attach(self._pub, config.endpoint)
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self.replay_endpoint = _attach(self._replay, config.replay_endpoint, bind=True)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher",
                                        daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (topic %r%s)", self.endpoint, config.topic,
                    f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one batch (stamped now); drops it, counted, when the queue is full."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: %d batches dropped (the publisher queue is full)",
                               self.num_dropped)

    def shutdown(self) -> None:
        """Send what is queued (bounded by SHUTDOWN_TIMEOUT), join the thread, close."""
        deadline = time.monotonic() + self.SHUTDOWN_TIMEOUT
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.put(None, timeout=0.05)
                break
            except queue.Full:
                continue
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            logger.warning("KV events: the publisher thread did not stop within %g s",
                           self.SHUTDOWN_TIMEOUT)
            return  # it still owns the sockets: the process exit closes them
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=int(self.SHUTDOWN_TIMEOUT * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            try:
                payload = encode_batch(item[0], item[1], self.data_parallel_rank,
                                       self.int_hashes)
                seq = self.num_published.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
                self._buffer.append((self.num_published, payload))
                self.num_published += 1
            except Exception:  # never let one bad batch stop the stream
                logger.exception("KV events: publishing a batch failed")

    def _serve_replay(self) -> None:
        assert self._replay is not None
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: bad replay request (%d frames)", len(frames))
                return
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    self._replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        except zmq.ZMQError:
            logger.exception("KV events: answering a replay request failed")


def _attach(sock: zmq.Socket, endpoint: str, bind: bool | None = None) -> str:
    """Bind (wildcard, ipc, inproc; or `bind=True`) or connect; the endpoint as attached
    (a bound port 0 resolved to the port the OS picked)."""
    if bind is None:
        bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://",
                                                                           "inproc://"))
    if not bind:
        sock.connect(endpoint)
        return endpoint
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
