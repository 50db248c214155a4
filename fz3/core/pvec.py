"""A persistent (immutable-to-the-observer) array with O(1) reads and updates of the newest
version: Baker's trick, as in Conchon & Filliatre, "A Persistent Union-Find Data Structure"
(ML Workshop 2007), section 2.

    v0 --set--> v1 --set--> v2          the newest version owns the one real list;
    (diff)      (diff)      [list]      older versions hold {index: old value} + a newer version

Why: the core's state is immutable, yet a transition must cost O(params it touches), not
O(params in the model). Copying a 20 000-entry tuple per fetch would break that, and a 32-way
trie costs a path copy per update. Here `set_many` writes the changes into the list and turns
the old version into a small diff, so the shell, which always works on the newest state, pays
O(changes). Reading an older version still gives its own values: it first *reroots* (walks the
diffs back, swapping values, and takes the list), which costs O(changes in between). Every
version's contents never change, so `PVec` behaves as a value; it is not safe to use one
lineage from two threads at once (the core is single-threaded).

Cost of keeping old versions: an old version references the diffs of every later version, so
holding one keeps all changes since alive (and, in CPython, makes the GC walk them). The shell
holds only its newest state; a test that keeps a history pays memory for it, nothing else.
"""
from __future__ import annotations

from typing import Generic, Iterable, Iterator, Mapping, Optional, TypeVar

T = TypeVar("T")


class PVec(Generic[T]):
    """Fixed-length persistent vector: `set`/`set_many` return a new version, leaving this one."""

    __slots__ = ("_arr", "_diff")

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._arr: Optional[list] = list(items)
        self._diff: Optional[tuple[dict, "PVec[T]"]] = None

    def _reroot(self) -> list:
        path = []
        v = self
        while v._arr is None:
            path.append(v)
            v = v._diff[1]
        for u in reversed(path):
            olds, newer = u._diff
            arr = newer._arr
            news = {i: arr[i] for i in olds}
            for i, x in olds.items():
                arr[i] = x
            u._arr, u._diff = arr, None
            newer._arr, newer._diff = None, (news, u)
        return self._arr

    def __len__(self) -> int:
        arr = self._arr
        return len(arr if arr is not None else self._reroot())

    def __getitem__(self, i: int) -> T:
        arr = self._arr
        if arr is None:
            arr = self._reroot()
        if i < 0:
            raise IndexError(f"PVec index {i} out of range [0, {len(arr)})")
        return arr[i]

    def __iter__(self) -> Iterator[T]:
        arr = self._arr
        return iter(list(arr if arr is not None else self._reroot()))

    def current(self) -> list:
        """This version's backing list, for fast reads. Valid only until the next `set_many` on
        this lineage; never mutate it."""
        arr = self._arr
        return arr if arr is not None else self._reroot()

    def begin(self) -> tuple["PVec[T]", list, dict]:
        """Start the next version for in-place edits: -> (next version, its list, olds).

        The caller writes the next version's values into the list, recording each index's value
        from before its first write in `olds` (`if i not in olds: olds[i] = arr[i]`). This
        version then reads through `olds`. For hot loops that touch a few entries several times.
        """
        arr = self.current()
        olds: dict = {}
        new = PVec.__new__(PVec)
        new._arr, new._diff = arr, None
        self._arr, self._diff = None, (olds, new)
        return new, arr, olds

    def set(self, i: int, value: T) -> "PVec[T]":
        return self.set_many({i: value})

    def set_many(self, changes: Mapping[int, T]) -> "PVec[T]":
        """Apply {index: value} and return the new version; costs O(len(changes))."""
        if not changes:
            return self
        arr = self._arr
        if arr is None:
            arr = self._reroot()
        for i in changes:
            if not 0 <= i < len(arr):
                raise IndexError(f"PVec index {i} out of range [0, {len(arr)})")
        olds = {i: arr[i] for i in changes}
        for i, x in changes.items():
            arr[i] = x
        new = PVec.__new__(PVec)
        new._arr, new._diff = arr, None
        self._arr, self._diff = None, (olds, new)
        return new

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PVec) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PVec({list(self)!r})"


# [Note: log comparisons] A Log's list only grows: the items below a version's length never
# change (`extend` from an older version copies its prefix into a new list). So once two lists
# compared equal up to n, they stay equal up to n, and the next comparison of the same two
# lists looks only past it. A replayed pass compares its saved-param log with the recorded one at
# each Leave (117 a step on the deep narrow GPT, every param sharded, up to 393 items each:
# ~3 us a Leave, issue #48); remembering the last pair makes that the items added since. The
# pair is held (not by id), so neither list can be freed and its id reused while remembered;
# it is one tuple, replaced whole, so ranks run as threads never read half of another's.
_SEEN_EQUAL: list = [(None, None, 0)]  # [(list a, list b, n)]: a[:n] == b[:n]


class Log(Generic[T]):
    """Persistent append-only sequence: `extend` returns a new version, leaving this one.

    Versions share one list and each knows its length. Extending the newest version appends in
    place, O(items added); extending an older one (its list has grown past it) copies its
    prefix first. Why not a cons list: a cons cell is a tuple pointing at a tuple, which
    CPython's GC never untracks, so a pass over a 10 000-module model left ~20 000 tracked
    cells for every collection to walk; a Log of ints is one tracked list. Like PVec, one
    lineage is for one thread; make a fresh `Log()` for each empty start (never share one).
    """

    __slots__ = ("_items", "_n")

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._items: list = list(items)
        self._n = len(self._items)

    def extend(self, xs: Iterable[T]) -> "Log[T]":
        items = self._items
        if len(items) != self._n:
            items = items[:self._n]
        items.extend(xs)
        new = Log.__new__(Log)
        new._items, new._n = items, len(items)
        return new

    def __len__(self) -> int:
        return self._n

    def since(self, start: int) -> list[T]:
        """The items from index `start` of this version on."""
        return self._items[start:self._n]

    def __iter__(self) -> Iterator[T]:
        """Oldest first."""
        items, n = self._items, self._n
        return iter(items if len(items) == n else items[:n])

    def __eq__(self, other: object) -> bool:
        # the lengths first: a replayed Leave compares the pass's saved-param log with the
        # recorded one at every call it answers (replay.advance); both are empty where no pass
        # frees a param (calls.saves_matter). Then only what the last comparison of the same
        # two lists did not see ([Note: log comparisons])
        if not isinstance(other, Log) or self._n != other._n:
            return False
        n = self._n
        if n == 0:
            return True
        a, b = self._items, other._items
        memo = _SEEN_EQUAL[0]  # one read: thread ranks share it
        seen = memo[2] if memo[0] is a and memo[1] is b else 0
        if n > seen:
            if a[seen:n] != b[seen:n]:
                return False
            _SEEN_EQUAL[0] = (a, b, n)
        return True

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Log({list(self)!r})"

