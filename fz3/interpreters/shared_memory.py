"""Same-host point-to-point messages through shared memory, for the gloo carrier's data.

[Note: shared-memory carrier] gloo moves every point-to-point message over TCP, even between two
processes on one host: the sender's kernel copies it into the socket and runs the loopback's
protocol work, the receiver's copies it out. On the small benchmark GPT the forward's gather of
8 MiB each way took 3.5-4.7 ms of a rank's CPU (posting 2.0-2.9 ms, waiting 1.5-1.8); through
the rings below, a copy into memory both ranks map and one out of it, 2.5-2.9 ms (1.3-1.5 and
1.2-1.4; this rank's own shard copied into the full values in both), and the step 2-3 % less
timed in the same launch.

So when every rank of the group is on one host (one host name and boot id) and the CPU is
x86-64 (its stores become visible in order: a ring's counter never runs ahead of the bytes it
covers), the P2P carrier (p2p.py) sends its large messages through rings in shared memory:
one ring a direction a pair of ranks, `CAPACITY` bytes (1 MiB; with 256 KiB rings the small GPT
stepped 4.6 ms slower, with 512 KiB ones ~1.4 ms), made in /dev/shm and unlinked as soon as both ends have mapped them (nothing
is left behind, whatever happens later). Each rank's RSS grows by the rings it writes and reads:
2 (W - 1) MiB.

- A message is a 16-byte header (its bytes and its tag) and its bytes. Messages between two
  ranks travel in the order they were posted (the carrier posts them in group order on both
  sides, fz3.interpreters.messages); the receiver checks each header against the receive it posted.
- Messages below `SMALL` bytes, and every collective, go through gloo as before (`inner`).
- Nothing moves in the background: the bytes move while a rank posts or waits (`progress`,
  every queue of every peer), so a message completes once both ranks wait for it. A waiting
  rank polls the rings, after `SPIN` idle polls sleeping `NAP` between polls, so that its core
  is free for gloo's threads (yielding the core instead, the small GPT stepped 2-5 ms slower).
  Every rank waits for the same collectives in the same order (SPMD), and the divergence
  check's descriptors, which ride on gloo, are compared before any of a collective's data is
  read (agreement.Guarded).
- A header that is not the one expected (the ranks are at different collectives) stops that
  peer's stream where it is: no byte of it is read, and the wait fails naming both, after the
  descriptors have had their say. A peer whose process exits fails the wait within a tenth of
  a second of silence (`CHECK_EVERY`); one alive but not coming, after the transport's timeout,
  as on gloo.

Off unless asked for: `fz3.Options(shared_memory=True)`. Its cost: the rings take W (W - 1) MiB
of the host's /dev/shm (tmpfs, which a DataLoader's workers also use) for as long as the ranks
train, though their names are gone at once. Off also where /dev/shm cannot hold them (a rank that
cannot make or map one tells the others, and all stay on gloo).
"""
from __future__ import annotations

import datetime
import hashlib
import os
import platform
import secrets
import socket
import time
from collections import deque
from typing import Optional

import torch

CAPACITY = 1 << 20  # bytes of data in one ring
SMALL = 64 << 10  # messages below this many bytes go through gloo
HEADER = 16  # a message's header: int64 bytes, int64 tag
_HEAD, _TAIL = 0, 8  # int64 slots of a ring's control block (64-byte lines apart)
CONTROL = 128  # bytes before the data
SPIN = 64  # idle polls before a waiting rank starts sleeping between polls
NAP = 2e-5  # seconds
CHECK_EVERY = 0.1  # seconds between looks at a silent peer's process


class Ring:
    """One direction between two ranks: CONTROL bytes (the writer's head, the reader's tail) then
    CAPACITY bytes of data, in a file both map. `head` and `tail` count every
    byte ever written and read; this end's own counter is kept here, the other's read through."""

    def __init__(self, path: str) -> None:
        storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=CONTROL + CAPACITY)
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        control = whole[:CONTROL].view(torch.int64)
        self.head_cell, self.tail_cell = control[_HEAD], control[_TAIL]
        self.data = whole[CONTROL:]
        self.head = int(self.head_cell.item())
        self.tail = int(self.tail_cell.item())


def make_ring(path: str) -> Ring:
    """The ring file, written whole so that a full /dev/shm fails here (OSError), never later at
    a page of the mapping (SIGBUS)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, bytes(CONTROL + CAPACITY))
    finally:
        os.close(fd)
    return Ring(path)


class Message:
    """One send or receive in a peer's queue: its header, then its bytes; `at` counts the bytes
    moved of both."""

    __slots__ = ("peer", "tag", "header", "body", "size", "at", "done")

    def __init__(self, peer: int, tag: int, t: torch.Tensor) -> None:
        self.peer, self.tag = peer, tag
        self.body = t.view(-1).view(torch.uint8)
        self.size = HEADER + self.body.numel()
        self.header = torch.tensor([self.body.numel(), tag], dtype=torch.int64).view(torch.uint8)
        self.at = 0
        self.done = False

    def part(self, n: int) -> torch.Tensor:
        """The next piece to move, at most n bytes, not across the header's end."""
        if self.at < HEADER:
            return self.header[self.at:min(HEADER, self.at + n)]
        lo = self.at - HEADER
        return self.body[lo:lo + n]


class Work:
    """A message's completion; waiting moves every queued message it can (`progress`)."""

    __slots__ = ("transport", "message")

    def __init__(self, transport: "SharedMemoryTransport", message: Message) -> None:
        self.transport, self.message = transport, message

    def is_completed(self) -> bool:
        self.transport.progress()
        return self.message.done

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        self.transport.wait_for(self.message, timeout)
        return True


class SharedMemoryTransport:
    """The Transport interface (transport.py) over `inner`: large point-to-point messages through
    the rings, everything else through `inner`. Made by `for_carrier`."""

    def __init__(self, inner, outgoing: dict[int, Ring], incoming: dict[int, Ring], pids: dict[int, int]) -> None:
        """`pids`: each peer's process, watched while a wait on it is silent."""
        self.inner, self.out, self.inn, self.pids = inner, outgoing, incoming, pids
        self.rank, self.world_size, self.backend = inner.rank, inner.world_size, inner.backend
        self.sends: dict[int, deque[Message]] = {j: deque() for j in outgoing}
        self.recvs: dict[int, deque[Message]] = {j: deque() for j in incoming}
        self.mismatch: dict[int, str] = {}  # peer -> why its stream stopped
        self.moved = 0  # bytes this rank wrote into its rings (the tests read it)

    # ---- the point-to-point part ------------------------------------------------------------

    def isend(self, t: torch.Tensor, dst: int, tag: int):
        return self._post(self.sends, self.inner.isend, t, dst, tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int):
        return self._post(self.recvs, self.inner.irecv, t, src, tag)

    def _post(self, queues: dict[int, deque], by_gloo, t: torch.Tensor, peer: int, tag: int):
        """A small message by gloo; a large one queued for the ring to `peer`, moved as far as fits."""
        if t.numel() * t.element_size() < SMALL:
            return by_gloo(t, peer, tag)
        m = Message(peer, tag, _flat(t))
        queues[peer].append(m)
        self.progress()
        return Work(self, m)

    def progress(self) -> bool:
        """Move what fits: each peer's queued sends into its ring, each peer's ring into the
        queued receives. -> whether any byte moved."""
        moved = False
        for j, queue in self.sends.items():
            ring = self.out[j]
            while queue:
                m = queue[0]
                room = CAPACITY - (ring.head - int(ring.tail_cell.item()))
                if room <= 0:
                    break
                at = ring.head % CAPACITY
                piece = m.part(min(room, CAPACITY - at))
                k = piece.numel()
                ring.data[at:at + k].copy_(piece)
                ring.head += k
                ring.head_cell.fill_(ring.head)  # after the bytes: x86-64 keeps stores in order
                self.moved += k
                m.at += k
                moved = True
                if m.at == m.size:
                    m.done = True
                    queue.popleft()
        for j, queue in self.recvs.items():
            if j in self.mismatch:
                continue
            ring = self.inn[j]
            while queue:
                m = queue[0]
                ready = int(ring.head_cell.item()) - ring.tail
                if ready <= 0:
                    break
                at = ring.tail % CAPACITY
                piece = m.part(min(ready, CAPACITY - at))  # a header may come in pieces
                k = piece.numel()
                piece.copy_(ring.data[at:at + k])
                ring.tail += k
                ring.tail_cell.fill_(ring.tail)
                m.at += k
                moved = True
                if m.at == HEADER:
                    size, tag = m.header.view(torch.int64).tolist()
                    if size != m.body.numel() or tag != m.tag:  # none of its bytes is read
                        self.mismatch[j] = (f"rank {j} sent {size:,} bytes under tag {tag} where this rank "
                                            f"expected {m.body.numel():,} bytes under tag {m.tag}")
                        break
                if m.at == m.size:
                    m.done = True
                    queue.popleft()
        return moved

    def wait_for(self, m: Message, timeout: Optional[datetime.timedelta]) -> None:
        """Progress until `m` is done. RuntimeError when its peer's stream stopped at a header
        that was not the expected one, when the peer's process is gone, or after `timeout` (the
        transport's own when None) without `m` done."""
        limit = (timeout or self.inner.timeout()).total_seconds()
        began = last = time.monotonic()
        idle = 0
        while not m.done:
            if self.progress():
                idle = 0
                continue
            if m.peer in self.mismatch and m in self.recvs[m.peer]:
                raise RuntimeError(f"shared-memory messages out of step: {self.mismatch[m.peer]}")
            idle += 1
            if idle < SPIN:
                continue
            time.sleep(NAP)
            now = time.monotonic()
            if now - last >= CHECK_EVERY:
                last = now
                if not _alive(self.pids[m.peer]):
                    raise RuntimeError(f"rank {m.peer}'s process ({self.pids[m.peer]}) has exited "
                                       "(shared-memory message)")
                if now - began >= limit:
                    raise RuntimeError(f"shared-memory message with rank {m.peer} not done after {limit:.0f} s")

    # ---- the rest is gloo's ------------------------------------------------------------------

    def all_reduce(self, t, async_op=False):
        return self.inner.all_reduce(t, async_op=async_op)

    def all_gather_into(self, out, inp, async_op=False):
        return self.inner.all_gather_into(out, inp, async_op=async_op)

    def reduce_scatter_into(self, out, inp, async_op=False):
        return self.inner.reduce_scatter_into(out, inp, async_op=async_op)

    def broadcast(self, t, src=0):
        return self.inner.broadcast(t, src=src)

    def timeout(self) -> datetime.timedelta:
        return self.inner.timeout()

    def side(self):
        return self.inner.side()


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose memory the ring reads or writes as it lies (the carrier's are flat)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"shared-memory messages take contiguous CPU tensors, not {tuple(t.shape)} with strides "
                         f"{t.stride()} on {t.device}")
    return t


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _host() -> int:
    """This host, as an int64: its name and boot id (containers on one machine may share a name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    digest = hashlib.blake2b((socket.gethostname() + "/" + boot).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


def supported() -> bool:
    """Linux on x86-64 with /dev/shm."""
    return (platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
            and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK))


def for_carrier(inner, enabled: bool = True):
    """`inner` with its large point-to-point messages through shared memory when every rank of its
    group is on this host ([Note: shared-memory carrier]); else `inner` itself. Every rank must
    call it: the ranks agree on the host and on the rings' names through `inner`."""
    if not enabled or inner.backend != "gloo" or inner.world_size < 2:
        return inner
    W, rank = inner.world_size, inner.rank
    me = torch.tensor([_host(), int(supported()), secrets.randbits(62), os.getpid()], dtype=torch.int64)
    every = torch.empty(W * me.numel(), dtype=torch.int64)
    inner.all_gather_into(every, me)
    rows = every.view(W, -1).tolist()
    if any(r[0] != rows[0][0] or not r[1] for r in rows):
        return inner
    token, pids = rows[0][2], {j: r[3] for j, r in enumerate(rows) if j != rank}
    name = lambda src, dst: f"/dev/shm/fz3-{token:x}-{src}-{dst}"  # noqa: E731
    outgoing, incoming, made = {}, {}, []

    def everyone(ok: bool) -> bool:  # every rank's ok, agreed
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        inner.all_reduce(flag)
        return int(flag) == W

    ok = True
    try:
        try:
            for j in range(W):
                if j != rank:
                    made.append(name(rank, j))
                    outgoing[j] = make_ring(made[-1])
        except OSError:
            ok = False
        ok = everyone(ok)
        try:
            for j in range(W) if ok else ():
                if j != rank:
                    incoming[j] = Ring(name(j, rank))
        except (OSError, RuntimeError):
            ok = False
        ok = everyone(ok)  # and mapped the others': nothing needs the files now
    finally:  # whatever happened (a peer gone mid-setup too), no file is left in /dev/shm
        for path in made:
            try:
                os.unlink(path)
            except OSError:
                pass
    return SharedMemoryTransport(inner, outgoing, incoming, pids) if ok else inner
