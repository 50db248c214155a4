"""A persistent (immutable, structurally shared) vector: a 32-way trie of tuples.

Why: the core's state is immutable, yet a transition must cost O(params it touches), not
O(params in the model). Copying a 20 000-entry tuple per fetch would break that; replacing one
entry of a PVec copies only the log32(n) nodes on its path (three 32-tuples for 32 768 entries).
"""
from __future__ import annotations

from typing import Generic, Iterable, Iterator, Sequence, TypeVar

T = TypeVar("T")
BITS = 5
WIDTH = 1 << BITS
MASK = WIDTH - 1


class PVec(Generic[T]):
    """Fixed-length persistent vector. `set`/`set_many` return a new PVec; reads are O(log32 n)."""

    __slots__ = ("_root", "_len", "_shift")

    def __init__(self, items: Iterable[T] = ()) -> None:
        leaves: list[tuple] = []
        items = list(items)
        for i in range(0, len(items), WIDTH):
            leaves.append(tuple(items[i:i + WIDTH]))
        shift = 0
        nodes: list[tuple] = leaves or [()]
        while len(nodes) > 1:
            nodes = [tuple(nodes[i:i + WIDTH]) for i in range(0, len(nodes), WIDTH)]
            shift += BITS
        self._root, self._len, self._shift = nodes[0], len(items), shift

    @classmethod
    def _make(cls, root: tuple, length: int, shift: int) -> "PVec[T]":
        new = cls.__new__(cls)
        new._root, new._len, new._shift = root, length, shift
        return new

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> T:
        if not 0 <= i < self._len:
            raise IndexError(f"PVec index {i} out of range [0, {self._len})")
        node, shift = self._root, self._shift
        while shift:
            node = node[(i >> shift) & MASK]
            shift -= BITS
        return node[i & MASK]

    def __iter__(self) -> Iterator[T]:
        for i in range(self._len):
            yield self[i]

    def set(self, i: int, value: T) -> "PVec[T]":
        if not 0 <= i < self._len:
            raise IndexError(f"PVec index {i} out of range [0, {self._len})")
        return PVec._make(_set(self._root, self._shift, i, value), self._len, self._shift)

    def set_many(self, pairs: Sequence[tuple[int, T]]) -> "PVec[T]":
        root = self._root
        for i, value in pairs:
            if not 0 <= i < self._len:
                raise IndexError(f"PVec index {i} out of range [0, {self._len})")
            root = _set(root, self._shift, i, value)
        return PVec._make(root, self._len, self._shift)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PVec) and len(self) == len(other) and all(
            a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PVec({list(self)!r})"


def _set(node: tuple, shift: int, i: int, value: object) -> tuple:
    j = (i >> shift) & MASK
    child = value if shift == 0 else _set(node[j], shift - BITS, i, value)
    return node[:j] + (child,) + node[j + 1:]
