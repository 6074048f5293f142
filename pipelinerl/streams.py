"""Append-only streams between processes, on a filesystem that may be shared between nodes.

A stream is a directory; every writer appends to its own file (`<writer>.jsonl`), so writers never interleave
bytes. A record is one line: an 8-hex-digit CRC32 of the JSON text, a space, the JSON text. A reader walks
every file from its saved byte offsets and yields whole records; a line whose checksum or JSON is wrong (a torn
write from a crashed writer, a corrupted disk block) is skipped and counted, never fatal. A trailing line
without its newline is an append in progress and is left for the next read.

Where the user runs a Redis server, `streams.backend: redis` keeps the same streams in Redis Streams instead: one
key per stream (`<prefix>:<name>`), one entry per record holding the same checksummed encoding, so a corrupt
entry is skipped and counted exactly as a corrupt line is. A reader's position is the last entry id it read.
`open_writer` / `open_reader` pick the backend from the run's `streams` config, so callers need not care.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from pipelinerl.config import StreamsConfig

log = logging.getLogger(__name__)


# Streams have no notification, so a waiting reader polls. A wait that ends soon (a small model's step takes tens
# of milliseconds) is noticed within FAST_POLL_S; past FAST_WINDOW_S a wait is long next to any poll, and polling
# slows to SLOW_POLL_S (50 reads a second, nothing next to a step of seconds).
FAST_POLL_S = 0.002
SLOW_POLL_S = 0.02
FAST_WINDOW_S = 0.25


def poll_interval(waited_s: float) -> float:
    """How long a reader that has waited `waited_s` seconds for a record sleeps before it reads again."""
    return FAST_POLL_S if waited_s < FAST_WINDOW_S else SLOW_POLL_S


class PollWait:
    """A reader's wait for a record, from its start (or its last `restart`): the sleep before the next read."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.since = time.monotonic()

    def interval(self) -> float:
        return poll_interval(time.monotonic() - self.since)

    def sleep(self) -> None:
        time.sleep(self.interval())


def encode_record(data: Any) -> bytes:
    text = json.dumps(data, separators=(",", ":"))
    return f"{zlib.crc32(text.encode()):08x} {text}\n".encode()


def decode_record(line: bytes) -> Any:
    """The record's data; raises ValueError for a corrupt line."""
    text = line.rstrip(b"\n").decode("utf-8")
    crc, _, payload = text.partition(" ")
    if len(crc) != 8 or int(crc, 16) != zlib.crc32(payload.encode()):
        raise ValueError("checksum mismatch")
    return json.loads(payload)


class StreamWriter:
    def __init__(self, stream_dir: str | os.PathLike, writer: str, fsync: bool = False):
        self.path = Path(stream_dir) / f"{writer}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")
        self._fsync = fsync
        self.written = 0

    def write(self, data: Any) -> None:
        self.write_many([data])

    def write_many(self, records: list[Any]) -> None:
        # One write call per batch: a group of samples lands whole or (on a crash) torn and skipped.
        self._file.write(b"".join(encode_record(r) for r in records))
        self._file.flush()
        if self._fsync:
            os.fsync(self._file.fileno())
        self.written += len(records)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Follow:
    """`follow()` for any reader with a non-blocking `read()`."""

    def read(self) -> list[Any]:
        raise NotImplementedError

    def follow(self, poll_s: float = 0.05, timeout_s: float | None = None) -> Iterator[Any]:
        """Yield records as they arrive; stops after `timeout_s` without new records (None: never)."""
        idle_since = time.monotonic()
        while True:
            records = self.read()
            if records:
                idle_since = time.monotonic()
                yield from records
            elif timeout_s is not None and time.monotonic() - idle_since > timeout_s:
                return
            else:
                time.sleep(poll_s)


class StreamReader(_Follow):
    """Reads every writer's file of a stream from saved offsets; `position` can be saved and restored."""

    def __init__(self, stream_dir: str | os.PathLike, position: dict[str, int] | None = None):
        self.dir = Path(stream_dir)
        self.position: dict[str, int] = dict(position or {})
        self.corrupt = 0

    def read(self) -> list[Any]:
        """Every complete record appended since the last read, file by file."""
        out: list[Any] = []
        if not self.dir.is_dir():
            return out
        for path in sorted(self.dir.glob("*.jsonl")):
            out.extend(self._read_file(path))
        return out

    def _read_file(self, path: Path) -> Iterator[Any]:
        offset = self.position.get(path.name, 0)
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        for line in chunk[: end + 1].splitlines(keepends=True):
            try:
                yield decode_record(line)
            except (ValueError, UnicodeDecodeError):
                self.corrupt += 1
                log.warning("skipped a corrupt record in %s (%d so far)", path, self.corrupt)
        self.position[path.name] = offset + end + 1


def save_position(reader: StreamReader | RedisStreamReader, path: str | os.PathLike) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"position": reader.position, "corrupt": reader.corrupt}))
    os.replace(tmp, path)


def load_position(path: str | os.PathLike) -> dict[str, Any]:
    """A saved position: byte offsets per file (files backend) or the last entry id per key (redis backend)."""
    p = Path(path)
    return json.loads(p.read_text())["position"] if p.exists() else {}


# --- Redis Streams ----------------------------------------------------------------------------------------------

RECORD_FIELD = b"r"  # the checksummed record, encoded exactly as a line of a stream file
WRITER_FIELD = b"w"  # which writer appended the entry (for people inspecting the stream with redis-cli)
READ_BATCH = 1000  # entries per XRANGE round trip


class StreamBackendError(RuntimeError):
    """The stream backend cannot be used (Redis unreachable, client missing); the message says what to do."""


def redacted_url(url: str) -> str:
    """`url` without its password, for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _unreachable(url: str, error: Exception) -> StreamBackendError:
    port = urlsplit(url).port or 6379
    return StreamBackendError(
        f"streams.redis_url: cannot reach Redis at {redacted_url(url)} ({str(error).rstrip('.')}). Start a server "
        f"there (e.g. `redis-server --port {port}`), point streams.redis_url at a running one, "
        f"or use streams.backend=files")


@contextlib.contextmanager
def _redis_errors(url: str) -> Iterator[None]:
    """Turn the client's connection errors into one clear StreamBackendError naming the config key."""
    import redis

    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        raise _unreachable(url, e) from e


def connect_redis(url: str) -> Any:
    """A client for `url`, checked with a PING so a wrong URL fails here and not at the first record."""
    try:
        import redis
    except ImportError:
        raise StreamBackendError("streams.backend=redis needs the Redis client: pip install -e '.[redis]' "
                                 "(or pip install 'redis>=5'), or use streams.backend=files") from None
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30)
    except ValueError as e:  # a malformed URL
        raise StreamBackendError(f"streams.redis_url: {e}") from None
    with _redis_errors(url):
        client.ping()
    return client


def _next_id(entry_id: str) -> str:
    """The smallest entry id after `entry_id`: XRANGE's start is inclusive, and the exclusive `(id` form needs
    Redis 6.2, so step past the last id read by hand (ids are `milliseconds-sequence`)."""
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


class RedisStreamWriter:
    """Appends records to the Redis stream `key` at `url`; any number of writers may share a key."""

    def __init__(self, url: str, key: str, writer: str):
        self.client, self.key, self.writer, self.url = connect_redis(url), key, writer, url
        self.written = 0

    def write(self, data: Any) -> None:
        self.write_many([data])

    def write_many(self, records: list[Any]) -> None:
        # MULTI/EXEC: a batch (a group of samples) lands whole and contiguous, never interleaved with another
        # writer's entries; the trainer relies on groups arriving together, as one file append gives them.
        pipe = self.client.pipeline(transaction=True)
        for r in records:
            pipe.xadd(self.key, {WRITER_FIELD: self.writer, RECORD_FIELD: encode_record(r)})
        with _redis_errors(self.url):
            pipe.execute()
        self.written += len(records)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> RedisStreamWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisStreamReader(_Follow):
    """Reads the Redis stream `key` at `url` after the last entry id in `position` (`{key: "ms-seq"}`), which can
    be saved and restored like a file reader's offsets."""

    def __init__(self, url: str, key: str, position: dict[str, Any] | None = None):
        self.client, self.key, self.url = connect_redis(url), key, url
        self.position: dict[str, Any] = dict(position or {})
        self.corrupt = 0

    def read(self) -> list[Any]:
        """Every record appended since the last read, in stream order."""
        out: list[Any] = []
        while True:
            last = self.position.get(self.key, "0-0")
            with _redis_errors(self.url):
                entries = self.client.xrange(self.key, min=_next_id(last), max="+", count=READ_BATCH)
            for entry_id, fields in entries:
                self._decode(entry_id, fields, out)
                self.position[self.key] = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if len(entries) < READ_BATCH:
                return out

    def _decode(self, entry_id: Any, fields: dict, out: list[Any]) -> None:
        try:
            out.append(decode_record(fields[RECORD_FIELD]))
        except (KeyError, ValueError, UnicodeDecodeError):
            # A foreign or damaged entry costs one record, never the run; the position moves past it.
            self.corrupt += 1
            log.warning("skipped a corrupt entry %s in %s (%d so far)", entry_id, self.key, self.corrupt)

    def close(self) -> None:
        self.client.close()


# --- choosing the backend from the run's config ------------------------------------------------------------------

def streams_dir(run_dir: str | os.PathLike) -> Path:
    """Where the files backend keeps a run's streams."""
    return Path(run_dir) / "streams"


RUN_ID_FILE = "redis_streams_id"


def run_stream_id(run_dir: str | os.PathLike, wait_s: float = 10.0) -> str:
    """A random id kept in the run directory, made by whichever process asks first. Keys named after it, not after
    the path, are never shared by two runs: a run dir deleted and started afresh at the same path gets new keys
    instead of the old run's samples."""
    path = Path(run_dir) / RUN_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # the actor and the trainer may race here
    except FileExistsError:
        deadline = time.monotonic() + wait_s
        while not (text := path.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.01)  # the winner has created the file but not written it yet
        if not text:
            raise StreamBackendError(f"{path} is empty; delete it or set streams.redis_prefix") from None
        return text
    run_id = secrets.token_hex(4)
    with os.fdopen(fd, "w") as f:
        f.write(run_id)
    return run_id


def redis_prefix(cfg: StreamsConfig, run_dir: str | os.PathLike) -> str:
    """The run's key prefix: `streams.redis_prefix`, else `pipelinerl:<run dir name>-<run_stream_id>`, so two runs
    on one Redis never share a stream."""
    if cfg.redis_prefix:
        return cfg.redis_prefix
    return f"pipelinerl:{Path(run_dir).resolve().name}-{run_stream_id(run_dir)}"


def stream_key(cfg: StreamsConfig, run_dir: str | os.PathLike, name: str) -> str:
    return f"{redis_prefix(cfg, run_dir)}:{name}"


def open_writer(cfg: StreamsConfig, run_dir: str | os.PathLike, name: str,
                writer: str) -> StreamWriter | RedisStreamWriter:
    """A writer for the run's stream `name` (`samples`, `control`) on the configured backend."""
    if cfg.backend == "redis":
        return RedisStreamWriter(cfg.redis_url, stream_key(cfg, run_dir, name), writer)
    return StreamWriter(streams_dir(run_dir) / name, writer)


def open_reader(cfg: StreamsConfig, run_dir: str | os.PathLike, name: str,
                position: dict[str, Any] | None = None) -> StreamReader | RedisStreamReader:
    """A reader of the run's stream `name` from `position` (None: the beginning) on the configured backend."""
    if cfg.backend == "redis":
        return RedisStreamReader(cfg.redis_url, stream_key(cfg, run_dir, name), position)
    return StreamReader(streams_dir(run_dir) / name, position)


def check_backend(cfg: StreamsConfig) -> None:
    """Raise StreamBackendError now if the configured backend cannot be used (for a launcher's early check)."""
    if cfg.backend == "redis":
        connect_redis(cfg.redis_url).close()


def reset_stream(cfg: StreamsConfig, run_dir: str | os.PathLike, name: str) -> None:
    """Delete the run's stream `name` on the configured backend (the launcher does this to `control` per launch)."""
    if cfg.backend == "redis":
        client = connect_redis(cfg.redis_url)
        try:
            with _redis_errors(cfg.redis_url):
                client.delete(stream_key(cfg, run_dir, name))
        finally:
            client.close()
    else:
        import shutil

        shutil.rmtree(streams_dir(run_dir) / name, ignore_errors=True)
