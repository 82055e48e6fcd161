"""Copy-on-write containers over one shared, never-mutated base.

Used by :meth:`hetmesh.discovery.membership.Membership.adopt_view` so that
thousands of simulated nodes that start from the same converged mesh share one
member table: each node holds only what it changed (the entries it touched, the
slots of its live list it rewrote), not its own copy of N entries. A node that
never adopts a view keeps plain dicts, lists and sets; the protocol code is the
same for both. Pure: no I/O.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, MutableMapping
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")
T = TypeVar("T")


class CowDict(MutableMapping[K, V]):
    """A dict whose unchanged keys are read from ``base``.

    Mutable values (a member's entry) are copied into this node's own layer the
    first time they are read, since the protocol changes them in place; with
    ``copy_values=False`` (immutable values) reads never copy.
    """

    __slots__ = ("_base", "_copy", "_extra", "_gone", "_own")

    def __init__(self, base: dict[K, V], *, copy_values: bool = True) -> None:
        self._base = base
        self._own: dict[K, V] = {}
        self._gone: set[K] = set()  # base keys deleted here
        self._extra = 0  # own keys absent from the base
        self._copy: Callable[[V], V] | None = copy.copy if copy_values else None

    def __getitem__(self, key: K) -> V:
        own = self._own
        if key in own:
            return own[key]
        if key in self._gone:
            raise KeyError(key)
        value = self._base[key]
        if self._copy is not None:  # the caller may change it in place: make it ours
            value = own[key] = self._copy(value)
        return value

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return key in self._own or (key not in self._gone and key in self._base)

    def __setitem__(self, key: K, value: V) -> None:
        if key not in self._own:
            if key in self._base:
                self._gone.discard(key)
            else:
                self._extra += 1
        self._own[key] = value

    def __delitem__(self, key: K) -> None:
        if key not in self:
            raise KeyError(key)
        self._own.pop(key, None)
        if key in self._base:
            self._gone.add(key)
        else:
            self._extra -= 1

    def __iter__(self) -> Iterator[K]:
        own = list(self._own)  # a snapshot: reading base keys adds them to _own
        yield from own
        seen = set(own)
        for key in list(self._base):
            if key not in seen and key not in self._gone:
                yield key

    def __len__(self) -> int:
        return len(self._base) - len(self._gone) + self._extra


class CowList(Generic[T]):
    """A list with ``base``'s items, holding only the slots rewritten here.

    Supports what the membership's live list needs: length, indexing, item
    assignment, ``append``, ``pop()`` from the end, iteration.
    """

    __slots__ = ("_base", "_len", "_own")

    def __init__(self, base: list[T]) -> None:
        self._base = base
        self._own: dict[int, T] = {}
        self._len = len(base)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __getitem__(self, i: int) -> T:
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        own = self._own.get(i, self)
        return self._base[i] if own is self else own  # type: ignore[return-value]

    def __setitem__(self, i: int, value: T) -> None:
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(i)
        self._own[i] = value

    def append(self, value: T) -> None:
        self._own[self._len] = value
        self._len += 1

    def pop(self) -> T:
        if not self._len:
            raise IndexError("pop from an empty list")
        value = self[self._len - 1]
        self._own.pop(self._len - 1, None)
        self._len -= 1
        return value

    def __iter__(self) -> Iterator[T]:
        # one C-speed copy of the base, then our slots: a node's probe order copies
        # its live list once a lap, 10,000 items at a time in a large simulation
        items = self._base[: self._len]
        for i, value in self._own.items():
            if i < len(items):
                items[i] = value
        items += [self._own[i] for i in range(len(items), self._len)]
        return iter(items)


class CowSet(Generic[T]):
    """A set with ``base``'s members plus those added here (``add`` and ``in`` only)."""

    __slots__ = ("_base", "_own")

    def __init__(self, base: set[T] | frozenset[T]) -> None:
        self._base = base
        self._own: set[T] = set()

    def __contains__(self, item: object) -> bool:
        return item in self._own or item in self._base

    def add(self, item: T) -> None:
        if item not in self._base:
            self._own.add(item)


__all__ = ["CowDict", "CowList", "CowSet"]
