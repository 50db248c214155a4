"""The buffer pool (fz3/data/pool.py): a buffer is handed out again only once nothing but the
pool holds its storage, and the pool keeps at most its byte limit."""
from __future__ import annotations

import torch

from fz3.data.pool import BufferPool

CPU = torch.device("cpu")


def ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_reused_only_when_every_reference_is_gone():
    pool = BufferPool(CPU, limit_bytes=1 << 20)
    a = pool.take(16, torch.float32)
    first, view = ptr(a), a[4:8]  # the view: e.g. a param's .data, or a tensor autograd saved
    del a
    b = pool.take(16, torch.float32)
    assert ptr(b) != first  # still referenced through the view: a new buffer
    del view
    c = pool.take(16, torch.float32)
    assert ptr(c) == first and pool.misses == 2 and pool.hits == 1
    assert pool.take(16, torch.bfloat16).dtype == torch.bfloat16  # dtype is part of the key
    assert pool.take(8, torch.float32).shape == (8,)


def test_byte_limit_evicts_free_buffers_least_recently_used_first():
    pool = BufferPool(CPU, limit_bytes=100 * 4)
    pool.take(40, torch.float32)  # free at once (nothing keeps it)
    pool.take(50, torch.float32)
    assert pool.bytes == 90 * 4
    held = pool.take(30, torch.float32)  # needs room: the 40 goes (least recently used)
    assert pool.bytes == 80 * 4 and (40, torch.float32) not in pool.buffers
    big = pool.take(200, torch.float32)  # can never fit: handed out untracked
    assert pool.bytes == 80 * 4 and big.numel() == 200 and held.numel() == 30
    assert ptr(pool.take(30, torch.float32)) != ptr(held)  # the 30 is in use: not handed out twice


def test_no_room_means_plain_allocations():
    """limit 0 (the interpreter's choice on an accelerator): nothing is kept, nothing reused."""
    pool = BufferPool(CPU, limit_bytes=0)
    pool.take(1024, torch.float32)
    assert pool.bytes == 0 and not pool.buffers and pool.misses == 1
    pool.take(1024, torch.float32)
    assert pool.hits == 0 and pool.misses == 2


def test_trim_drops_what_the_last_window_did_not_use():
    """engine.step() trims at each boundary: sizes that a window did not ask for go (an
    evaluation's, the first step's before the trace existed); buffers in use never do."""
    pool = BufferPool(CPU, limit_bytes=1 << 20)
    pool.take(10, torch.float32)
    in_use = pool.take(20, torch.float32)
    pool.trim()  # everything was taken in this window: nothing goes
    assert pool.bytes == 30 * 4
    pool.take(10, torch.float32)  # the next window uses the 10 only
    assert pool.trim() == 0 and pool.bytes == 30 * 4  # the 20 is in use: kept
    del in_use
    pool.take(10, torch.float32)
    assert pool.trim() == 20 * 4 and list(pool.buffers) == [(10, torch.float32)]


def test_a_miss_drops_free_buffers_not_used_since_the_last_boundary():
    """The first traced step gathers in new sizes: the untraced step's per-module buffers go
    before the new ones are made, not after the peak (wide model: 1155 -> 971 MiB RSS)."""
    pool = BufferPool(CPU, limit_bytes=1 << 20)
    for n in (11, 12, 13):  # step 1: one size per module
        pool.take(n, torch.float32)
    pool.trim()  # boundary: all were used in that window
    pool.take(36, torch.float32)  # step 2: one prefetch gather of all three
    assert list(pool.buffers) == [(36, torch.float32)] and pool.bytes == 36 * 4


def test_eviction_of_one_buffer_among_equal_sizes():
    """Two free buffers of one size: dropping one must not compare tensors with == (elementwise:
    'Boolean value of Tensor ... is ambiguous')."""
    pool = BufferPool(CPU, limit_bytes=64 * 4)
    a, b = pool.take(16, torch.float32), pool.take(16, torch.float32)
    a.fill_(1), b.fill_(2)
    del b  # the second is free, the first still in use
    pool.take(40, torch.float32)  # room for 40 needs the free 16 gone
    assert pool.bytes == 56 * 4 and len(pool.kept((16, torch.float32))) == 1
    assert a.untyped_storage().data_ptr() == pool.kept((16, torch.float32))[0].untyped_storage().data_ptr()


def test_discard_stops_keeping_a_buffer_its_users_still_hold():
    pool = BufferPool(torch.device("cpu"), limit_bytes=1 << 20)
    a = pool.take(10, torch.float32)
    b = pool.take(10, torch.float32)
    view = a.view(2, 5)  # a param's .data
    assert pool.discard(view) == 40 and pool.bytes == 40
    assert pool.discard(view) == 0  # not kept any more
    assert pool.discard(torch.empty(0)) == 0  # an empty placeholder is no buffer
    del a
    c = pool.take(10, torch.float32)  # view still holds a: it is never handed out again
    assert c.untyped_storage().data_ptr() not in (view.untyped_storage().data_ptr(),)
    assert b.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()  # b is in use


def test_release_drops_every_free_buffer():
    pool = BufferPool(torch.device("cpu"), limit_bytes=1 << 20)
    kept = pool.take(10, torch.float32)
    pool.take(20, torch.float32)  # free at once
    assert pool.release() == 80 and pool.bytes == 40  # the one in use stays
    assert list(pool.buffers) == [(10, torch.float32)] and kept.numel() == 10


def test_a_buffer_in_use_at_two_releases_in_a_row_is_kept_no_more():
    """[Note: resident buffers]: a persistent param's full value is asked at one end of backward,
    then let go of; one handed out again between the two ends stays kept."""
    pool = BufferPool(CPU, limit_bytes=1 << 20)
    resident = pool.take(10, torch.float32)
    passing = pool.take(20, torch.float32)
    assert pool.release() == 0 and len(pool.kept()) == 2  # both in use: both kept
    del passing
    passing = pool.take(20, torch.float32)  # freed and gathered again in the next pass: a hit
    assert pool.hits == 1
    assert pool.release() == 0  # both in use again; resident was not taken since: let go of
    assert pooled(pool) == [ptr(passing)] and pool.bytes == 80
    assert pool.discard(resident) == 0  # not kept: nothing to discard
    del passing
    assert pool.release() == 80 and pool.kept() == []


def pooled(pool: BufferPool) -> list[int]:
    """The storages the pool keeps, by data pointer."""
    return [ptr(t) for t in pool.kept()]


def test_every_hit_is_counted():
    pool = BufferPool(CPU, limit_bytes=1 << 20)
    for _ in range(3):
        pool.take(16, torch.float32)  # free again at once: the later two reuse the first
    assert pool.misses == 1 and pool.hits == 2


def test_stats_report_bytes_hits_and_misses():
    pool = BufferPool(CPU, limit_bytes=1 << 20)
    pool.take(16, torch.float32)
    pool.take(16, torch.float32)
    pool.take(8, torch.bfloat16)
    assert pool.stats() == {"pool_bytes": 16 * 4 + 8 * 2, "pool_hits": 1, "pool_misses": 2}


def test_buffers_live_on_the_pools_device():
    """The pool allocates on its own device, not the default one (meta stands in for an
    accelerator here)."""
    pool = BufferPool(torch.device("meta"), limit_bytes=1 << 20)
    assert pool.take(16, torch.float32).device.type == "meta"
    with torch.device("meta"):
        assert BufferPool(CPU, limit_bytes=1 << 20).take(16, torch.float32).device == CPU


def test_eviction_stops_as_soon_as_the_buffer_fits_exactly():
    """The least recently used free buffers go only until the new one fits; at exactly the limit
    it is kept, and the later keys stay."""
    pool = BufferPool(CPU, limit_bytes=100 * 4)
    for n in (20, 30, 40):
        pool.take(n, torch.float32)  # free at once
    pool.take(60, torch.float32)  # 90 + 60 > 100: the 20 and the 30 go, 40 + 60 = 100
    assert pool.bytes == 100 * 4 and list(pool.buffers) == [(40, torch.float32), (60, torch.float32)]


def test_eviction_within_one_size_stops_at_an_exact_fit():
    pool = BufferPool(CPU, limit_bytes=100 * 4)
    a = pool.take(30, torch.float32)
    b = pool.take(30, torch.float32)  # a in use: a second 30
    del a, b  # both free
    pool.take(70, torch.float32)  # 60 + 70 > 100: one 30 goes, 30 + 70 = 100
    assert pool.bytes == 100 * 4 and len(pool.buffers[(30, torch.float32)]) == 1
    assert (70, torch.float32) in pool.buffers


def test_eviction_drops_several_buffers_of_one_size_when_needed():
    pool = BufferPool(CPU, limit_bytes=100 * 4)
    a = pool.take(30, torch.float32)
    b = pool.take(30, torch.float32)
    del a, b
    pool.take(90, torch.float32)  # 60 + 90 > 100: both 30s must go for the 90 to be kept
    assert pool.bytes == 90 * 4 and list(pool.buffers) == [(90, torch.float32)]


def test_room_made_by_dropping_every_free_buffer_to_exactly_the_limit():
    pool = BufferPool(CPU, limit_bytes=100 * 4)
    in_use = pool.take(40, torch.float32)
    pool.take(30, torch.float32)  # free at once
    pool.take(60, torch.float32)  # 40 in use + 60 = 100: the free 30 goes, the 60 is kept
    assert pool.bytes == 100 * 4 and list(pool.buffers) == [(40, torch.float32), (60, torch.float32)]
    assert in_use.numel() == 40


def test_discard_drops_exactly_the_buffer_given_and_its_bytes():
    pool = BufferPool(CPU, limit_bytes=1 << 20)
    a = pool.take(10, torch.float32)
    b = pool.take(10, torch.float32)  # a in use: a second buffer of the same key
    c = pool.take(20, torch.float32)
    assert pool.bytes == 40 * 4
    assert pool.discard(a[2:]) == 10 * 4 and pool.bytes == 30 * 4
    assert pooled(pool) == [ptr(b), ptr(c)]  # the other buffer of a's size stays
    assert pool.discard(c) == 20 * 4 and pool.bytes == 10 * 4
    assert list(pool.buffers) == [(10, torch.float32)]  # c's key is gone with its last buffer


def test_a_discard_and_a_miss_walk_no_buffers(monkeypatch):
    """[Note: pool bookkeeping]: with 200 sizes kept, a discard finds its buffer by its storage
    pointer (it reads two storages, not every buffer's), and a miss asks only the buffers not
    taken since the last trim whether they are in use; a hit only those of its own size."""
    from fz3.data import pool as pool_module
    pool = BufferPool(torch.device("cpu"), limit_bytes=1 << 30)
    held = [pool.take(n, torch.float32) for n in range(1, 201)]
    storages = []
    real_storage = torch.Tensor.untyped_storage
    monkeypatch.setattr(torch.Tensor, "untyped_storage", lambda t: storages.append(t.numel()) or real_storage(t))
    assert pool.discard(held[99].view(4, 25)) == 400
    assert len(storages) <= 3, storages  # the view's, the buffer's: no walk over the 200
    monkeypatch.setattr(torch.Tensor, "untyped_storage", real_storage)
    asked: list[int] = []
    real = pool_module._users
    monkeypatch.setattr(pool_module, "_users", lambda t: asked.append(t.numel()) or real(t))
    pool.take(1000, torch.float32)  # a miss: every buffer was taken in this window
    assert asked == []
    del held[:]
    pool.take(7, torch.float32)  # a hit: only size 7's one buffer is asked
    assert asked == [7]
    pool.trim()  # a new window: now every kept buffer is a candidate of the next miss
    asked.clear()
    pool.take(1001, torch.float32)
    assert len(asked) == 200  # 199 of the first sizes (one discarded) and the 1000: all free, dropped
    assert pool.bytes == 1001 * 4


def test_takes_of_one_size_ask_one_buffer_each(monkeypatch):
    """[Note: pool bookkeeping]: 100 buffers of one size (the full values of 100 equal params),
    all freed, then taken again one by one: each take asks the buffer at the front of its size's
    queue, which is free, where asking from the start of a list asked 1, 2, ..., 100 (5050)."""
    from fz3.data import pool as pool_module
    pool = BufferPool(torch.device("cpu"), limit_bytes=1 << 30)
    held = [pool.take(32, torch.float32) for _ in range(100)]
    asked: list[int] = []
    real = pool_module._users
    monkeypatch.setattr(pool_module, "_users", lambda t: asked.append(t.numel()) or real(t))
    for _ in range(3):  # three steps: free every value, take them all again
        del held[:]
        held = [pool.take(32, torch.float32) for _ in range(100)]
    assert len(asked) == 300 and pool.hits == 300 and pool.misses == 100, (len(asked), pool.hits, pool.misses)
    held.append(pool.take(32, torch.float32))  # all 100 in use: one look at each, then a miss
    assert len(asked) == 400 and pool.misses == 101


def test_one_gather_asks_each_buffer_once(monkeypatch):
    """[Note: pool bookkeeping]: a gather's full values are taken as one batch (take_many). With
    100 buffers of its size all in use, a batch of 100 asks each of them once, then makes 100
    new ones, where taking them one at a time asked 100, 101, ..., 199 (14,950); a batch of 100
    after they were all freed asks 100 and hits 100, as single takes would."""
    from fz3.data import pool as pool_module
    pool = BufferPool(torch.device("cpu"), limit_bytes=1 << 30)
    held = pool.take_many([32] * 100, torch.float32)
    asked: list[int] = []
    real = pool_module._users
    monkeypatch.setattr(pool_module, "_users", lambda t: asked.append(t.numel()) or real(t))
    more = pool.take_many([32] * 100, torch.float32)  # all 100 in use
    assert len(asked) == 100 and pool.misses == 200 and pool.hits == 0, (len(asked), pool.misses)
    assert len({t.data_ptr() for t in held + more}) == 200  # nobody's buffer handed out twice
    del held[:], more[:]
    asked.clear()
    again = pool.take_many([32] * 100 + [7], torch.float32)
    assert len(asked) == 100 and pool.hits == 100 and pool.misses == 201, (len(asked), pool.hits, pool.misses)
    assert [t.numel() for t in again] == [32] * 100 + [7]


def test_full_values_below_min_bytes_are_plain_tensors():
    """[Note: small buffers unpooled]: take_many hands out a plain tensor below `min_bytes` (the
    heap's allocator reuses that memory itself), neither kept nor counted; `take` (a
    collective's scratch) pools whatever its size."""
    pool = BufferPool(torch.device("cpu"), limit_bytes=1 << 30, min_bytes=1024)
    small, big = pool.take_many([255, 256], torch.float32)  # 1020 and 1024 bytes
    assert [ptr(t) for t in pool.kept()] == [ptr(big)] and small.numel() == 255
    assert pool.bytes == 1024 and (pool.hits, pool.misses) == (0, 1)
    half = pool.take_many([511, 512], torch.bfloat16)  # the bound is in bytes, whatever the dtype
    assert [t.numel() for t in pool.kept()] == [256, 512] and half[1].dtype == torch.bfloat16
    scratch = pool.take(10, torch.float32)
    assert pool.bytes == 1024 + 1024 + 40 and scratch.numel() == 10
