"""Host-side bookkeeping of the paged KV pool: which blocks are free, referenced or cached.

The device holds ``NB`` blocks of ``block_size`` positions (``jaxprm.models.paged``); this module
decides who owns them. Block 0 is the null block: never handed out, the target of padding writes
and of unused block-table entries.

A block is in exactly one of three states:

* **referenced** (``refcount > 0``): part of one or more sequences' block tables (sequences that
  share a cached prefix share its blocks);
* **evictable**: unreferenced but holding a cached prefix (a node of the ``PrefixCache``); kept in
  least-recently-released order and reused only when no plain free block is left; reusing one
  evicts its cache node first (``on_evict``);
* **free**: unreferenced and uncached.

``allocate`` hands out free blocks first, then evicts the least recently released cached ones (LRU).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

__all__ = ["BlockPool", "NULL_BLOCK"]

NULL_BLOCK = 0


class BlockPool:
    """Reference counts, the free list and the LRU list of cached unreferenced blocks.

    Args:
      num_blocks: blocks on the device, the null block included (so ``num_blocks - 1`` usable).
      on_evict: called with a cached block id just before it is reused; it must drop the block from
        the cache (``uncache``) and may drop others.
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.on_evict = on_evict
        self._ref = [0] * self.num_blocks
        self._cached = [False] * self.num_blocks
        self._free: collections.deque[int] = collections.deque(range(1, self.num_blocks))
        self._free_set = set(self._free)
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()

    # queries -----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Usable blocks (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_available(self) -> int:
        """Blocks ``allocate`` can hand out now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_referenced(self) -> int:
        return self.capacity - self.num_available

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return self._cached[block]

    # allocation ------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with refcount 1 (free ones first, then LRU cached ones, evicted).

        Raises ``MemoryError`` (and changes nothing) when fewer than ``n`` are available.
        """
        if n > self.num_available:
            raise MemoryError(f"{n} KV blocks requested, {self.num_available} available")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
                self._free_set.discard(b)
            else:
                b, _ = self._evictable.popitem(last=False)
                if self.on_evict is not None:
                    self.on_evict(b)
                self._cached[b] = False
            self._ref[b] = 1
            out.append(b)
        return out

    def incref(self, block: int) -> None:
        """Take one more reference (a sequence starts using a cached block)."""
        self._check(block)
        if self._ref[block] == 0:
            if block in self._evictable:
                del self._evictable[block]
            else:
                self._free.remove(block)
                self._free_set.discard(block)
        self._ref[block] += 1

    def decref(self, block: int) -> None:
        """Drop one reference; at zero the block becomes evictable (cached) or free."""
        self._check(block)
        if self._ref[block] <= 0:
            raise RuntimeError(f"KV block {block} released more often than taken")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._cached[block]:
                self._evictable[block] = None  # most recently released: evicted last
            else:
                self._free.append(block)
                self._free_set.add(block)

    # cache membership (driven by the PrefixCache) ----------------------------------------------
    def mark_cached(self, block: int) -> None:
        self._check(block)
        if self._ref[block] == 0:
            raise RuntimeError(f"only a referenced KV block can enter the cache (block {block})")
        self._cached[block] = True

    def uncache(self, block: int) -> None:
        """The block left the cache: if unreferenced it becomes plain free."""
        self._check(block)
        if not self._cached[block]:
            return
        self._cached[block] = False
        if self._ref[block] == 0 and block in self._evictable:
            del self._evictable[block]
            self._free.append(block)
            self._free_set.add(block)

    def _check(self, block: int) -> None:
        if not (0 < block < self.num_blocks):
            raise ValueError(f"KV block id {block} outside [1, {self.num_blocks})")

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (tests)."""
        for b in range(1, self.num_blocks):
            in_free, in_evict = b in self._free_set, b in self._evictable
            if self._ref[b] > 0:
                assert not in_free and not in_evict, b
            else:
                assert in_free != in_evict, b
                assert in_evict == self._cached[b], b
        assert len(self._free_set) == len(self._free)
