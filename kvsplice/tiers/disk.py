"""The disk tier: one file per entry in a directory, under a byte budget, least recently used out.

Writes go to a temporary file in the same directory and are renamed over the entry (os.replace is
atomic on POSIX), so a reader sees a whole entry or none, and two writers of the same key leave one
whole copy. Nothing is fsync'ed: after a crash a file may be cut short, and the digest every read
verifies turns that into a counted, deleted miss. A read touches the file's mtime, which orders the
entries when a new process indexes the directory. Several processes may share a directory safely
(atomic renames, verified reads); each enforces the budget over the entries it knows of.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

from kvsplice.errors import ConfigError
from kvsplice.tiers.tier import Tier

SUFFIX = ".kv"
TEMP_SUFFIX = ".part"
# A temporary file older than this is a crashed writer's leftover, removed at start-up.
STALE_TEMP_S = 3600.0


class DiskTier(Tier):
    name = "disk"

    def __init__(self, directory: str | Path, budget_bytes: int) -> None:
        """Raises ConfigError if the directory cannot be created or written."""
        super().__init__()
        assert budget_bytes > 0
        self.directory = Path(directory)
        self.budget_bytes = budget_bytes
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe-{os.getpid()}-{uuid.uuid4().hex}{TEMP_SUFFIX}"
            probe.write_bytes(b"kvsplice")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"store_dir {str(directory)!r} cannot be created or written: {err}") from err
        self._lock = threading.Lock()
        # key -> size in bytes, least recently used first.
        self._index: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._scan()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def get(self, key: str) -> bytearray | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                n = f.readinto(data)
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as err:
            self.counters.error(self.name, "read", err)
            return None
        # The access time that orders eviction after a restart. The file may be gone meanwhile
        # (evicted, replaced): the bytes read are still whole.
        with contextlib.suppress(OSError):
            os.utime(path)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:  # written by another process sharing the directory
                self._index[key] = n
                self._used += n
        self.counters.add(bytes_read=n)
        return data[:n] if n != len(data) else data

    def put(self, key: str, data: bytes | bytearray) -> bool:
        size = len(data)
        if size > self.budget_bytes:
            self.counters.add(dropped_writes=1)
            return False
        victims = self._reserve(key, size)
        for victim in victims:
            self._unlink(self._path(victim))
        # A name of its own per writer: two writers of one key never share a temporary file.
        unique = f"{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}"
        temp = self.directory / f".{key}.{unique}{TEMP_SUFFIX}"
        try:
            with open(temp, "wb") as f:
                f.write(data)
            os.replace(temp, self._path(key))
        except OSError as err:
            self._unlink(temp)
            self._forget(key, size)
            self.counters.error(self.name, "write", err)
            return False
        self.counters.add(writes=1, bytes_written=size, evictions=len(victims))
        return True

    def delete(self, key: str) -> None:
        self._forget(key)
        self._unlink(self._path(key))

    def close(self) -> None:
        """Nothing stays open between calls."""

    def _path(self, key: str) -> Path:
        return self.directory / (key + SUFFIX)

    def _reserve(self, key: str, size: int) -> list[str]:
        """Account `size` bytes for `key`; the least recently used keys that must go to make room."""
        victims = []
        with self._lock:
            self._used -= self._index.pop(key, 0)
            while self._used + size > self.budget_bytes:
                victim, victim_size = self._index.popitem(last=False)
                self._used -= victim_size
                victims.append(victim)
            self._index[key] = size
            self._used += size
            assert 0 <= self._used <= self.budget_bytes, "disk budget accounting broken"
        return victims

    def _forget(self, key: str, size: int | None = None) -> None:
        """Drop `key` from the index (only if it is still accounted at `size`, when given)."""
        with self._lock:
            if key in self._index and (size is None or self._index[key] == size):
                self._used -= self._index.pop(key)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            self.counters.error(self.name, "delete", err)

    def _scan(self) -> None:
        """Index the entries already in the directory, oldest access first; drop stale temp files."""
        found = []
        now = time.time()
        with os.scandir(self.directory) as it:
            for item in it:
                try:
                    st = item.stat()
                except FileNotFoundError:
                    continue
                if item.name.endswith(SUFFIX) and item.is_file():
                    found.append((st.st_mtime, item.name[: -len(SUFFIX)], st.st_size))
                elif item.name.endswith(TEMP_SUFFIX) and now - st.st_mtime > STALE_TEMP_S:
                    self._unlink(Path(item.path))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used += size
        # The budget may have shrunk since the directory was filled.
        while self._used > self.budget_bytes:
            victim, victim_size = self._index.popitem(last=False)
            self._used -= victim_size
            self._unlink(self._path(victim))
            self.counters.add(evictions=1)
