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

import itertools
import json
import logging
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kdaserve.cache.ops import BLOCK, KINDS, SNAPSHOT

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
    persistent = True

    def __init__(self, directory: str | Path, identity: bytes, describe: dict,
                 min_free_bytes: int, name: str = "disk") -> None:
        self.name = name
        self.identity = identity
        self.root = Path(directory) / identity.hex()
        self._tmp_ids = itertools.count()
        try:
            for kind in KINDS:
                (self.root / kind).mkdir(parents=True, exist_ok=True)
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
        with open(self.path(kind, key), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            if f.readinto(buf) != size:
                raise EntryCorrupt("short read")
        view = memoryview(buf)
        _, position, chain, start, n, digest = self._parse(view, kind, key)
        if start + n != size:
            raise EntryCorrupt(f"{size} bytes on disk, header says {start + n}")
        payload = view[start:]
        if xxhash.xxh3_64_intdigest(payload) != digest:
            raise EntryCorrupt("checksum mismatch")
        return payload

    def drop(self, kind: str, key: bytes) -> None:
        self.path(kind, key).unlink(missing_ok=True)

    def scan(self) -> list[ScannedEntry]:
        """Every entry a previous run left, oldest first. Leftover temporary files (a crash
        mid-write) and snapshots whose header does not verify are deleted."""
        found = []
        for kind in KINDS:
            for path in (self.root / kind).glob("*/*"):
                try:
                    st = path.stat()
                    if _TMP in path.name:
                        path.unlink()
                        continue
                    key = bytes.fromhex(path.name)
                    if kind == BLOCK:
                        found.append(ScannedEntry(kind, key, st.st_size, st.st_mtime))
                        continue
                    with open(path, "rb") as f:
                        head = f.read(_HEAD.size)
                        (n_chain,) = struct.unpack_from("<I", head, 12) if len(head) >= 16 \
                            else (0,)
                        head += f.read(16 * n_chain + _SUM.size)
                    _, position, chain, _, _, _ = self._parse(memoryview(head), kind, key)
                    found.append(ScannedEntry(kind, key, st.st_size, st.st_mtime, position,
                                              chain))
                except (ValueError, EntryCorrupt, OSError) as exc:
                    logger.warning("offload: dropping unreadable entry %s (%s)", path, exc)
                    path.unlink(missing_ok=True)
        found.sort(key=lambda e: e.mtime)
        return found

    # ---- helpers ----------------------------------------------------------------------------
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
