"""The offload tiers' storage: bytes in host memory, or one file per entry on disk.

Torch-free on purpose: a store holds opaque payloads (the runner turns tensors into bytes and
back), so it lives beside the bookkeeping without pulling tensors into cache/. The runner is
the only caller (it executes the cache operations); the bookkeeping never reads a store.

Every entry carries an xxh3-64 checksum of its payload, checked on every load: a mismatch, a
short file, a wrong key, model identity or kind raises `EntryCorrupt`, which the runner turns
into a miss (the data is recomputed). Disk writes go to a temporary name in the same directory
and are renamed into place, so a crash leaves either the old state or the whole new entry; a
torn write that the rename made visible anyway (power loss without fsync) fails its checksum.

Disk layout: DIR/<identity hex>/<kind>/<2 hex>/<key hex>, identity = model + cache layout
(see identity.py), so another model or layout finds nothing. File = header + payload:
  magic, kind, chain length, identity, key, payload length, payload xxh3-64, position,
  chain (16 bytes per block hash), xxh3-64 of the header so far.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import xxhash

from kdaserve.cache.ops import KINDS, SNAPSHOT

logger = logging.getLogger("kdaserve")

_MAGIC = b"KDASOFF1"
_HEAD = struct.Struct("<8sB3xI16s16sQQQ")
_SUM = struct.Struct("<Q")
_TMP = ".tmp-"


class OffloadError(RuntimeError):
    """A tier that cannot work at all (unwritable directory, full disk): raised at startup."""


class EntryCorrupt(Exception):
    """An entry that fails verification on load."""


@dataclass(frozen=True)
class ScannedEntry:
    kind: str
    key: bytes
    file_bytes: int
    mtime: float
    position: int = 0
    chain: tuple[bytes, ...] = ()


class HostStore:
    """Payloads in host memory. `alloc(n)` returns a writable n-byte buffer: plain bytearrays on
    CPU, pinned memory when the device is CUDA (so copies to the device can be asynchronous)."""

    persistent = False

    def __init__(self, name: str = "host",
                 alloc: Callable[[int], memoryview] | None = None) -> None:
        self.name = name
        self._alloc = alloc or (lambda n: memoryview(bytearray(n)))
        self._entries: dict[tuple[str, bytes], tuple[memoryview, int]] = {}

    def put(self, kind: str, key: bytes, payload: memoryview, position: int = 0,
            chain: tuple[bytes, ...] = ()) -> None:
        buf = self._alloc(len(payload))
        buf[:] = payload
        self._entries[(kind, key)] = (buf, xxhash.xxh3_64_intdigest(buf))

    def get(self, kind: str, key: bytes) -> memoryview:
        try:
            buf, digest = self._entries[(kind, key)]
        except KeyError:
            raise EntryCorrupt("not in the host tier") from None
        if xxhash.xxh3_64_intdigest(buf) != digest:
            raise EntryCorrupt("checksum mismatch")
        return buf

    def drop(self, kind: str, key: bytes) -> None:
        self._entries.pop((kind, key), None)

    def scan(self) -> list[ScannedEntry]:
        return []


class DiskStore:
    """One file per entry. Nothing here may block or stop a start: only regular files are
    opened (lstat before, fstat after, O_NONBLOCK so a FIFO planted in place of an entry cannot
    hang the open), an entry's size is checked against its header and the layout before its
    payload is read, and whatever fails is removed (directories included) and counted in
    `dropped`, never raised out of a scan."""

    persistent = True

    def __init__(self, directory: str | Path, identity: bytes, describe: dict,
                 min_free_bytes: int, name: str = "disk",
                 payload_bytes: dict[str, int] | None = None) -> None:
        self.name = name
        self.identity = identity
        self.root = Path(directory) / identity.hex()
        # the payload size of each kind in this layout; None accepts any (tests of the store)
        self.payload_bytes = payload_bytes or {}
        self.dropped = 0               # entries the scans removed as unreadable
        self._tmp_ids = itertools.count()
        try:
            for kind in KINDS:
                _clear_unless(self.root / kind, stat.S_ISDIR)
                (self.root / kind).mkdir(parents=True, exist_ok=True)
            _clear_unless(self.root / "identity.json", stat.S_ISREG)
            self._write(self.root / "identity.json",
                        json.dumps(describe, indent=1, sort_keys=True).encode())
        except OSError as exc:
            raise OffloadError(f"offload directory {directory} is not writable: {exc}") from None
        free = shutil.disk_usage(self.root).free
        if free < min_free_bytes:
            raise OffloadError(f"offload directory {directory} has {free} bytes free; one entry "
                               f"needs up to {min_free_bytes}")

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.root).free

    def path(self, kind: str, key: bytes) -> Path:
        h = key.hex()
        return self.root / kind / h[:2] / h

    # ---- entries ----------------------------------------------------------------------------
    def put(self, kind: str, key: bytes, payload: memoryview, position: int = 0,
            chain: tuple[bytes, ...] = ()) -> None:
        head = _HEAD.pack(_MAGIC, KINDS.index(kind), len(chain), self.identity, key,
                          len(payload), xxhash.xxh3_64_intdigest(payload), position)
        head += b"".join(chain)
        head += _SUM.pack(xxhash.xxh3_64_intdigest(head))
        path = self.path(kind, key)
        path.parent.mkdir(exist_ok=True)
        self._write(path, head, payload)

    def get(self, kind: str, key: bytes) -> memoryview:
        with self._open(self.path(kind, key)) as (f, size):
            _, _, _, _, n, digest = self._read_head(f, size, kind, key)
            buf = bytearray(n)
            if f.readinto(buf) != n:
                raise EntryCorrupt("short read")
        payload = memoryview(buf)
        if xxhash.xxh3_64_intdigest(payload) != digest:
            raise EntryCorrupt("checksum mismatch")
        return payload

    def drop(self, kind: str, key: bytes) -> None:
        _remove(self.path(kind, key))

    def scan(self) -> list[ScannedEntry]:
        """Every entry a previous run left, oldest first. Leftover temporary files (a crash
        mid-write), and entries whose header does not verify or whose size disagrees with it,
        are removed; so is anything that is not a regular file where an entry belongs."""
        found = []
        for kind in KINDS:
            for shard in _listdir(self.root / kind):
                if not stat.S_ISDIR(shard.stat(follow_symlinks=False).st_mode):
                    self._discard(Path(shard.path), "not a directory")
                    continue
                for entry in _listdir(Path(shard.path)):
                    path = Path(entry.path)
                    if _TMP in entry.name:
                        _remove(path)
                        continue
                    try:
                        key = bytes.fromhex(entry.name)
                        with self._open(path) as (f, size):
                            _, position, chain, _, _, _ = self._read_head(f, size, kind, key)
                            mtime = os.fstat(f.fileno()).st_mtime
                        found.append(ScannedEntry(kind, key, size, mtime, position, chain))
                    except (ValueError, EntryCorrupt, OSError) as exc:
                        self._discard(path, str(exc))
        found.sort(key=lambda e: e.mtime)
        return found

    # ---- helpers ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _open(self, path: Path) -> Iterator[tuple[BinaryIO, int]]:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise EntryCorrupt("not a regular file")
        # O_NONBLOCK: a FIFO swapped in after the lstat opens at once instead of waiting for a
        # writer, and then fails the fstat check
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise EntryCorrupt("not a regular file")
            yield f, st.st_size     # type: ignore[misc]

    def _read_head(self, f: BinaryIO, size: int, kind: str, key: bytes
                   ) -> tuple[int, int, tuple[bytes, ...], int, int, int]:
        """Reads and verifies the header; checks the file's size against it (and the payload
        size against the layout) before anyone allocates a payload buffer."""
        head = f.read(_HEAD.size)
        (n_chain,) = struct.unpack_from("<I", head, 12) if len(head) >= 16 else (0,)
        if _HEAD.size + 16 * n_chain + _SUM.size > size:
            raise EntryCorrupt("truncated header")
        head += f.read(16 * n_chain + _SUM.size)
        parsed = self._parse(memoryview(head), kind, key)
        start, n = parsed[3], parsed[4]
        want = self.payload_bytes.get(kind)
        if want is not None and n != want:
            raise EntryCorrupt(f"header says a payload of {n} bytes, the layout needs {want}")
        if start + n != size:
            raise EntryCorrupt(f"{size} bytes on disk, header says {start + n}")
        return parsed

    def _discard(self, path: Path, why: str) -> None:
        logger.warning("offload: dropping unreadable entry %s (%s)", path, why)
        self.dropped += 1
        _remove(path)

    def _parse(self, view: memoryview, kind: str, key: bytes
               ) -> tuple[int, int, tuple[bytes, ...], int, int, int]:
        if len(view) < _HEAD.size + _SUM.size:
            raise EntryCorrupt("truncated header")
        magic, k, n_chain, identity, stored_key, n, digest, position = _HEAD.unpack_from(view)
        end = _HEAD.size + 16 * n_chain
        if magic != _MAGIC or k >= len(KINDS) or len(view) < end + _SUM.size:
            raise EntryCorrupt("bad header")
        (head_sum,) = _SUM.unpack_from(view, end)
        if xxhash.xxh3_64_intdigest(view[:end]) != head_sum:
            raise EntryCorrupt("header checksum mismatch")
        if identity != self.identity or stored_key != key or KINDS[k] != kind:
            raise EntryCorrupt("entry belongs to another key, kind or model")
        chain = tuple(bytes(view[i:i + 16]) for i in range(_HEAD.size, end, 16)) \
            if kind == SNAPSHOT else ()
        return k, position, chain, end + _SUM.size, n, digest

    def _write(self, path: Path, *parts: bytes | memoryview) -> None:
        tmp = path.with_name(f"{path.name}{_TMP}{os.getpid()}-{next(self._tmp_ids)}")
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _listdir(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError as exc:
        logger.warning("offload: cannot list %s (%s)", path, exc)
        return []


def _clear_unless(path: Path, is_kind: Callable[[int], bool]) -> None:
    """Removes what sits at `path` unless it is of the wanted kind (a file where the layout
    needs a directory would otherwise stop every start)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not is_kind(mode):
        logger.warning("offload: removing %s, which is in the tier's way", path)
        _remove(path)


def _remove(path: Path) -> None:
    """Removes a file, link, FIFO or directory tree; logs instead of raising (a removal that
    fails must not stop a start or a step)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("offload: cannot remove %s (%s)", path, exc)
