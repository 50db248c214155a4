"""The disk tier: the bytes of some tensors' storages in a file each, read and written by threads
while the caller goes on (DeepSpeed: runtime/swap_tensor/, over its libaio op; fz3 uses Python
threads over os.pread / os.pwrite, which release the GIL, so no compiled extension is needed and
nothing is built at first use).

    disk = DiskTier(path, rank=r, block_size=1 << 20, threads=1, needed=bytes)
    disk.write(key, tensors)      start writing the storages `tensors` lie in to file `key`
    disk.await_write(key)         the write has landed; their memory is given back (resized to 0:
                                  every view of them stays, unreadable until read back)
    disk.read(key)                their memory again, filled from the file, in the background
    disk.await_read(key)          the read has landed
    disk.restore(key)             their memory again, not read: for a caller about to overwrite it
    disk.read_range(key, offset, into)   some bytes of a file into a tensor, now (a param's shard)
    f = disk.read_range_async(key, offset, into); disk.await_range(f)   the same, in the background
    disk.stats()                  bytes read and written, seconds waited on the disk
    disk.close()                  files and folder removed (also when the tier is collected, at
                                  exit, and after a failed write; a process that ends by
                                  os._exit skips the exit handlers: `close_all` first, as
                                  fz3.launch's ranks do)

The folder is a fresh one under `path` (fz3-rank<r>-*), so two ranks or two engines never share a
file. A write has landed when its bytes are on the drive (fdatasync), and the page cache lets go
of what was written or read (POSIX_FADV_DONTNEED): what the tier holds is on disk, not quietly in
RAM, as DeepSpeed's O_DIRECT reads and writes. Before anything is written, `needed` bytes must be free on `path`'s file system: an error
names the path and both numbers.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch


class DiskTier:
    def __init__(self, path: str, *, rank: int, block_size: int = 1 << 20, threads: int = 1,
                 needed: int = 0, what: str = "offload_optimizer.nvme_path") -> None:
        if not os.path.isdir(path):
            raise FileNotFoundError(f"zero_optimization.{what} = {path!r}: no such folder; create it on the NVMe "
                                    "drive, or name one that exists")
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(f"zero_optimization.{what} = {path!r}: this process (uid {os.getuid()}) cannot "
                                  "write there; name a folder it can write to")
        free = shutil.disk_usage(path).free
        if free < needed:
            raise OSError(f"zero_optimization.{what} = {path!r}: {free / 2**30:.2f} GiB free, and the offloaded state "
                          f"needs {needed / 2**30:.2f} GiB ({needed:,} bytes for the ranks of this host); free space "
                          "there, or name a larger drive")
        self.dir = tempfile.mkdtemp(prefix=f"fz3-rank{rank}-", dir=path)
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, True)
        _OPEN.add(self)
        self.block_size = block_size
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fz3-disk")
        self.threads = threads
        self.storages: dict[object, list[tuple[torch.UntypedStorage, int]]] = {}  # key -> (storage, nbytes)
        self.pending: dict[object, list[Future]] = {}
        self.bytes_read = self.bytes_written = 0
        self.wait_seconds = 0.0

    def file(self, key: object) -> str:
        name = "-".join(map(str, key)) if isinstance(key, tuple) else str(key)
        return os.path.join(self.dir, f"{name}.bin")

    def write(self, key: object, tensors: Sequence[torch.Tensor]) -> None:
        """Start writing the storages of `tensors` (each once) to `key`'s file."""
        if key in self.pending:
            raise RuntimeError(f"fz3 disk tier: {key!r} is already being read or written")
        seen, storages = set(), []
        for t in tensors:
            s = t.untyped_storage()
            if s._cdata not in seen and s.nbytes():
                seen.add(s._cdata)
                storages.append((s, s.nbytes()))
        self.storages[key] = storages
        self.pending[key] = self._split(key, storages, write=True)
        self.bytes_written += sum(n for _, n in storages)

    def await_write(self, key: object) -> None:
        """The write of `key` has landed: its storages' memory goes."""
        self._wait(key)
        for s, _ in self.storages[key]:
            s.resize_(0)

    def read(self, key: object) -> None:
        """Start reading `key` back into the storages it was written from."""
        if key in self.pending:
            raise RuntimeError(f"fz3 disk tier: {key!r} is already being read or written")
        storages = self.storages[key]
        for s, n in storages:
            s.resize_(n)
        self.pending[key] = self._split(key, storages, write=False)
        self.bytes_read += sum(n for _, n in storages)

    def await_read(self, key: object) -> None:
        self._wait(key)

    def restore(self, key: object) -> None:
        """The memory `key` was written from, back and unread (its contents undefined): for
        tensors about to be overwritten whole (a sub-group's stepped params' shards)."""
        if key in self.pending:
            raise RuntimeError(f"fz3 disk tier: {key!r} is being read or written")
        for s, n in self.storages[key]:
            s.resize_(n)

    def read_range(self, key: object, offset: int, into: torch.Tensor) -> None:
        """Read bytes [offset, offset + into's bytes) of `key`'s file into `into` (a CPU tensor)
        now, on this thread: one param's shard for a gather."""
        start = time.perf_counter()
        self._read_range(key, offset, into)
        self.bytes_read += into.numel() * into.element_size()
        self.wait_seconds += time.perf_counter() - start

    def read_range_async(self, key: object, offset: int, into: torch.Tensor) -> Future:
        """`read_range` on the tier's threads: a param's shard read ahead of its gather."""
        self.bytes_read += into.numel() * into.element_size()
        return self.pool.submit(self._read_range, key, offset, into)

    def await_range(self, future: Future) -> None:
        start = time.perf_counter()
        try:
            future.result()
        finally:
            self.wait_seconds += time.perf_counter() - start

    def _read_range(self, key: object, offset: int, into: torch.Tensor) -> None:
        n = into.numel() * into.element_size()
        fd = os.open(self.file(key), os.O_RDONLY)
        try:
            view, pos = _memory(into.untyped_storage(), into.storage_offset() * into.element_size(),
                                into.storage_offset() * into.element_size() + n), 0
            while pos < n:
                got = os.preadv(fd, [view[pos:pos + self.block_size]], offset + pos)
                if got <= 0:
                    raise OSError(f"fz3 disk tier: read nothing at byte {offset + pos} of {self.file(key)}")
                pos += got
            os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def on_disk(self, key: object) -> bool:
        """`key` was written and its memory given back."""
        return key in self.storages and key not in self.pending and all(s.nbytes() == 0 for s, _ in self.storages[key])

    def stats(self) -> dict[str, float]:
        return {"disk_bytes_read": self.bytes_read, "disk_bytes_written": self.bytes_written,
                "disk_wait_seconds": self.wait_seconds}

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self._finalizer()
        _OPEN.discard(self)

    # ---- the threads' work ---------------------------------------------------------------------

    def _split(self, key: object, storages, *, write: bool) -> list[Future]:
        """The file's byte range cut into one task per thread, each moving block_size at a time."""
        total = sum(n for _, n in storages)
        path = self.file(key)
        if write:
            with open(path, "wb") as f:
                f.truncate(total)
        per = -(-total // self.threads) if total else 0
        return [self.pool.submit(self._move, path, storages, a, min(a + per, total), write)
                for a in range(0, total, per or 1)] if total else []

    def _move(self, path: str, storages, start: int, end: int, write: bool) -> None:
        fd = os.open(path, os.O_WRONLY if write else os.O_RDONLY)
        try:
            offset = 0
            for s, n in storages:
                a, b = max(start, offset), min(end, offset + n)
                if a < b:
                    view = _memory(s, a - offset, b - offset)
                    pos = 0
                    while pos < len(view):
                        chunk = view[pos:pos + self.block_size]
                        moved = os.pwrite(fd, chunk, a + pos) if write else os.preadv(fd, [chunk], a + pos)
                        if moved <= 0:
                            raise OSError(f"fz3 disk tier: {'wrote' if write else 'read'} nothing at byte {a + pos} "
                                          f"of {path}")
                        pos += moved
                offset += n
            if write:  # landed means on the drive, as DeepSpeed's O_DIRECT writes
                os.fdatasync(fd)
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)  # and not kept in RAM as page cache
        finally:
            os.close(fd)

    def _wait(self, key: object) -> None:
        start = time.perf_counter()
        futures = self.pending.pop(key, [])
        try:
            for f in futures:
                f.result()
        except BaseException:
            self._finalizer()  # the files go with a failed write or read
            raise
        finally:
            self.wait_seconds += time.perf_counter() - start


_OPEN: "weakref.WeakSet[DiskTier]" = weakref.WeakSet()  # the tiers whose files are still there


def close_all() -> None:
    """Close every open tier, its files removed: for a process about to end by os._exit, which
    skips the exit handlers that would (fz3.launch's ranks do, after their work)."""
    for tier in list(_OPEN):
        tier.close()


def _memory(storage: torch.UntypedStorage, start: int, end: int) -> memoryview:
    """Bytes [start, end) of a CPU storage, as a memoryview the file calls read and write. Not
    through numpy: torch marks a storage it hands to numpy as no longer resizable, and the disk
    tier gives the memory back by resizing it."""
    return memoryview((ctypes.c_ubyte * (end - start)).from_address(storage.data_ptr() + start)).cast("B")
