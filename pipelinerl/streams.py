"""Append-only streams between processes, on a filesystem that may be shared between nodes.

A stream is a directory; every writer appends to its own file (`<writer>.jsonl`), so writers never interleave
bytes. A record is one line: an 8-hex-digit CRC32 of the JSON text, a space, the JSON text. A reader walks
every file from its saved byte offsets and yields whole records; a line whose checksum or JSON is wrong (a torn
write from a crashed writer, a corrupted disk block) is skipped and counted, never fatal. A trailing line
without its newline is an append in progress and is left for the next read.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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


class StreamReader:
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


def save_position(reader: StreamReader, path: str | os.PathLike) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"position": reader.position, "corrupt": reader.corrupt}))
    os.replace(tmp, path)


def load_position(path: str | os.PathLike) -> dict[str, int]:
    p = Path(path)
    return json.loads(p.read_text())["position"] if p.exists() else {}
