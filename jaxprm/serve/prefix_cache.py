"""Prefix cache: a radix tree over full KV blocks, keyed by their tokens.

Each node holds one full block of ``block_size`` token ids and the pool block that holds their keys
and values, computed for exactly the path of tokens from the root (a block's KV depends on every
token before it). A request whose prompt starts with the tokens of a path reuses those blocks and
prefills only the rest. Only full blocks are shared, so a sequence never writes into a shared block
(no copy-on-write).

* ``match(tokens)`` walks the tree block by block and returns the blocks of the longest cached
  prefix (ready blocks only), and whether the walk stopped at a block some running sequence is
  still computing (``pending``): the engine then lets the request wait a step instead of
  prefilling the same tokens twice (``n`` copies of one prompt, GRPO groups).
* ``insert(tokens, blocks, ready=...)`` adds a sequence's blocks under the path of its tokens; where
  a node for the same tokens exists already the sequence's own block simply stays private.
* Eviction is LRU over unreferenced cached blocks, done by ``BlockPool``: reusing a cached block
  drops its node and the subtree under it (a subtree block still in use stays with its sequence,
  only uncached). Sequences release their blocks tail first, so the ends of paths go first.
* ``flush(version)`` drops every node: cached KV is only valid for the weights that computed it.

Counters (tokens): ``queries`` (prompt tokens looked up) and ``hits`` (of those, found cached).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxprm.serve.kv_pool import BlockPool

__all__ = ["PrefixCache"]


class _Node:
    __slots__ = ("key", "block", "parent", "children", "ready")

    def __init__(self, key: tuple[int, ...] | None, block: int, parent: _Node | None, ready: bool):
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.ready = ready


class PrefixCache:
    """Radix tree of full token blocks over a ``BlockPool`` (see the module docstring).

    ``enabled=False`` keeps the interface but caches nothing (every match is empty).
    """

    def __init__(self, pool: BlockPool, block_size: int, *, enabled: bool = True, version: int = 0):
        self.pool = pool
        self.block_size = int(block_size)
        self.enabled = bool(enabled)
        self.version = int(version)
        self._root = _Node(None, 0, None, True)
        self._by_block: dict[int, _Node] = {}
        self.queries = 0
        self.hits = 0
        pool.on_evict = self._evict

    def __len__(self) -> int:
        return len(self._by_block)

    def _keys(self, tokens: Sequence[int], n_blocks: int):
        bs = self.block_size
        return (tuple(tokens[i * bs:(i + 1) * bs]) for i in range(n_blocks))

    # lookups -----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], *, count: bool = True) -> tuple[list[int], bool]:
        """Blocks of the longest ready cached prefix of ``tokens`` (full blocks only) and whether
        the next block is cached but not computed yet. ``count`` adds to the query/hit counters."""
        blocks: list[int] = []
        pending = False
        if self.enabled:
            node = self._root
            for key in self._keys(tokens, len(tokens) // self.block_size):
                child = node.children.get(key)
                if child is None:
                    break
                if not child.ready:
                    pending = True
                    break
                blocks.append(child.block)
                node = child
        if count:
            self.queries += len(tokens)
            self.hits += len(blocks) * self.block_size
        return blocks, pending

    # updates -----------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], blocks: Sequence[int], *, ready: bool) -> list[int]:
        """Put ``blocks[i]`` (holding ``tokens[i bs:(i + 1) bs]``) in the tree for each full block;
        returns the blocks that became cache nodes (the others were cached already or are
        duplicates of existing nodes and stay private)."""
        if not self.enabled:
            return []
        added = []
        node = self._root
        n = min(len(blocks), len(tokens) // self.block_size)
        for key, block in zip(self._keys(tokens, n), blocks[:n]):
            child = node.children.get(key)
            if child is None:
                if block in self._by_block:  # the block already sits elsewhere: stop here
                    break
                child = _Node(key, block, node, ready)
                node.children[key] = child
                self._by_block[block] = child
                self.pool.mark_cached(block)
                added.append(block)
            elif child.block == block and ready:
                child.ready = True
            node = child
        return added

    def mark_ready(self, block: int) -> None:
        """The block's KV is now computed (no-op if it is not a node, e.g. after a flush)."""
        node = self._by_block.get(block)
        if node is not None:
            node.ready = True

    def is_node(self, block: int) -> bool:
        return block in self._by_block

    def drop_unready(self, blocks: Sequence[int]) -> None:
        """Remove the nodes of these blocks that are not computed (their owner is going away)."""
        for b in blocks:
            node = self._by_block.get(b)
            if node is not None and not node.ready:
                self._remove(node)

    def flush(self, version: int | None = None) -> int:
        """Drop every node (blocks in use stay with their sequences); returns the nodes dropped."""
        n = len(self._by_block)
        for child in list(self._root.children.values()):
            self._remove(child)
        if version is not None:
            self.version = int(version)
        return n

    def _evict(self, block: int) -> None:
        node = self._by_block.get(block)
        if node is not None:
            self._remove(node)

    def _remove(self, node: _Node) -> None:
        """Detach ``node`` and its subtree from the tree and give their blocks back to the pool."""
        if node.parent is not None:
            node.parent.children.pop(node.key, None)
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.children = {}
            n.parent = None
            if self._by_block.get(n.block) is n:
                del self._by_block[n.block]
                self.pool.uncache(n.block)
