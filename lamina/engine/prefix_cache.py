"""Automatic prefix caching: a token-granular radix tree over one memory worker's KV slots.

Data in: token ids with the KV slots that hold their keys and values (a sequence's prompt
once it is prefilled, its whole context when it finishes). Data out: for a new
sequence, the longest cached prefix (any length, not a multiple of a block) and its slots,
which the scheduler shares into the sequence's table (`KVAllocator.adopt`): only the rest
of the prompt is computed.

Why one index per memory worker, kept in the engine: the engine already owns every
worker's allocator and places each sequence, so it can place a request on the worker
that holds the longest prefix of it, and evict with the queue in view; the memory
workers stay plain pools that never learn what a slot means. A slot's KV depends only on
the tokens at and before its position, so equal token prefixes share slots exactly.

The tree holds one allocator reference (`retain`) on each slot it caches; a running
sequence that reuses a prefix holds another. Eviction (`evict`) drops least recently used
leaves, token by token from their ends, and only slots no sequence holds: running
requests always win over cached ones. A sequence whose KV is split over workers is not
cached (its prefix has no single home).
"""
from __future__ import annotations

import heapq
import itertools

from lamina.memory.allocator import KVAllocator


class _Node:
    __slots__ = ("tokens", "slots", "children", "parent", "tick")

    def __init__(self, tokens: list[int], slots: list[int], parent: _Node | None, tick: int):
        self.tokens, self.slots = tokens, slots  # the edge into this node: one slot a token
        self.children: dict[int, _Node] = {}  # by first token
        self.parent, self.tick = parent, tick


class RadixCache:
    def __init__(self, alloc: KVAllocator):
        self.alloc = alloc
        self.root = _Node([], [], None, 0)
        self._clock = itertools.count(1)
        self.size = 0  # cached tokens (= slots referenced by the tree)
        self.hits = 0  # tokens served from the cache
        self.evicted = 0  # tokens evicted

    def match(self, tokens: list[int], limit: int | None = None) -> list[int]:
        """Slots of the longest cached prefix of `tokens` (at most `limit` long); marks
        the path recently used."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        node, pos, slots, tick = self.root, 0, [], next(self._clock)
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common_len(child.tokens, tokens, pos, limit)
            slots += child.slots[:k]
            child.tick = tick
            pos += k
            if k < len(child.tokens):
                break
            node = child
        return slots

    def insert(self, tokens: list[int], slots: list[int]) -> int:
        """Cache `tokens` whose KV is at `slots` (one each). Prefixes already cached keep
        their slots; -> how many tokens were newly cached."""
        if len(tokens) != len(slots):
            raise ValueError(f"{len(tokens)} tokens but {len(slots)} slots")
        node, pos, tick = self.root, 0, next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = _Node(list(tokens[pos:]), list(slots[pos:]), node, tick)
                self.alloc.retain(new.slots)
                node.children[tokens[pos]] = new
                self.size += len(new.slots)
                return len(new.slots)
            k = common_len(child.tokens, tokens, pos, len(tokens))
            if k < len(child.tokens):
                child = self._split(child, k)
            child.tick = tick
            node, pos = child, pos + k
        return 0

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut `child`'s edge after k tokens; -> the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.tokens[:k], child.slots[:k], parent, child.tick)
        parent.children[child.tokens[0]] = upper
        child.tokens, child.slots, child.parent = child.tokens[k:], child.slots[k:], upper
        upper.children[child.tokens[0]] = child
        return upper

    def evict(self, n: int) -> int:
        """Free at least `n` slots if the tree holds that many no sequence uses, least
        recently used leaves first, from their ends; -> slots freed."""
        freed = 0
        heap = [(x.tick, id(x), x) for x in self._leaves()]
        heapq.heapify(heap)
        while freed < n and heap:
            _, _, leaf = heapq.heappop(heap)
            # slots at the end of the leaf that only the tree holds
            own = 0
            while own < len(leaf.slots) and self.alloc.refcount(leaf.slots[-1 - own]) == 1:
                own += 1
            take = min(own, n - freed)
            if take == 0:
                continue  # a running sequence uses it all: evicting frees nothing
            gone, key = leaf.slots[len(leaf.slots) - take:], leaf.tokens[0]
            leaf.tokens, leaf.slots = leaf.tokens[:-take], leaf.slots[:-take]
            freed += len(self.alloc.release(gone))
            self.size -= take
            self.evicted += take
            if not leaf.slots:
                parent = leaf.parent
                assert parent is not None
                del parent.children[key]
                if parent is not self.root and not parent.children:
                    heapq.heappush(heap, (parent.tick, id(parent), parent))
        return freed

    def evictable(self) -> int:
        """Slots eviction could free now: as `evict` goes, from each leaf's end the
        slots the tree alone holds, and a node's own once its children all go. Not
        every slot the tree alone holds: a sequence that gave back positions inside a
        cached prefix (`streaming`) keeps the slots after them, and the tree's slots
        before those stay until it ends."""
        gone: dict[int, bool] = {}  # node -> whether eviction would take it whole
        total = 0
        for x in reversed(list(self._nodes())):  # every node after its descendants
            if all(gone[id(c)] for c in x.children.values()):
                own = 0
                while own < len(x.slots) and self.alloc.refcount(x.slots[-1 - own]) == 1:
                    own += 1
                total += own
                gone[id(x)] = own == len(x.slots)
            else:
                gone[id(x)] = False
        return total

    def clear(self) -> int:
        """Drop every entry (e.g. the worker's pool was lost); -> slots freed."""
        freed = 0
        for x in self._nodes():
            freed += len(self.alloc.release(x.slots))
        self.root.children.clear()
        self.size = 0
        return freed

    def forget(self) -> None:
        """Drop every entry without touching the allocator (it is being reset too)."""
        self.root.children.clear()
        self.size = 0

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())

    def _leaves(self):
        return [x for x in self._nodes() if not x.children]


def common_len(edge: list[int], tokens: list[int], pos: int, limit: int) -> int:
    """How many of `edge`'s tokens equal tokens[pos:limit]'s first ones."""
    k, n = 0, min(len(edge), limit - pos)
    while k < n and edge[k] == tokens[pos + k]:
        k += 1
    return k

