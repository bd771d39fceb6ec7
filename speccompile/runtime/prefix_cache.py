"""Automatic prefix caching that is exact by construction: KV rows of whole blocks of a prompt, and whole prompts.

A cached row may stand in for a prefill's row only if it is the same bits. What that allows depends on the graph:

* **Row-invariant graphs** (`Session.row_invariant`: the fused CPU graph with its one-row attention padding):
  a position's KV rows and logits are the same bits whatever pass computed them — any number of rows, any split
  of a prompt into passes (tests/test_prefix_cache.py checks splits down to one token). So the rows of a
  prompt's first n tokens depend only on those tokens, and any prefix of a cached prompt can be reused. The
  cache stores blocks of PREFIX_BLOCK tokens (as vLLM's 16-token KV blocks) and reuses down to the token (as
  SGLang's radix cache): a new prompt takes every whole block it shares with an earlier prompt (a shared
  system prompt, a resent conversation), then the leading rows of the cached block or prompt tail that
  shares the most tokens after them (`lookup(..., partial=True)`), and prefills the rest from there.
* **Other graphs**: a row's bits can depend on the shape of the pass (q, past length). The generation loop
  prefills in fixed chunks of `prefill_chunk` (C) tokens from position 0 (`Generation._prefill`), so the rows
  of chunk i, [i*C, (i+1)*C), come from a pass of q = C over the tokens [0, (i+1)*C) with a past of i*C rows:
  a prompt that starts with the same (i+1)*C tokens computes the same bits for them, and prefilling it from
  (i+1)*C on runs the same passes as a fresh prefill. The block is then the prefill chunk.

In both, a whole prompt's rows and last logits come from passes over the same token ids, so a repeat needs
no prefill pass at all.

The cache keeps only such entries, in a trie per (graph, block size): a node per whole block (its tokens, its
rows of every KV buffer) under the node of the blocks before it, and at a node the *tails* of whole prompts
that end after those blocks (the remaining < block tokens, or none: their rows and the prompt's last logits).
`lookup` returns the longest exact reuse; `store` adds what a finished prefill computed. Memory is bounded
in bytes (least recently used entries go first; an entry is always used together with its ancestors and
after them, so leaves go before the blocks they hang on). Every method holds the cache's lock: a server's
event loop may ask `whole_prompt_logits` while its decoder thread looks up and stores.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from ..errors import with_article

PREFIX_BLOCK = 16  # tokens per cached block on row-invariant graphs


@dataclass
class PrefixHit:
    """What the cache holds of one prompt: its first `rows` KV rows (a whole number of blocks, or the whole
    prompt) and, for a whole prompt, its last logits (`logits`: None on a partial hit)."""

    rows: int
    segments: list[tuple[int, list[np.ndarray]]]  # (first row, per-buffer rows [kv_heads, n, head_dim])
    logits: np.ndarray | None = None

    @property
    def full(self) -> bool:
        return self.logits is not None

    def copy_into(self, arrays: Sequence[np.ndarray]) -> None:
        """Write the rows into a cache's per-buffer arrays [1, kv_heads, capacity, head_dim] at [0, rows)."""
        for start, kv in self.segments:
            for array, rows in zip(arrays, kv):
                array[0, :, start: start + rows.shape[1]] = rows


@dataclass(eq=False)
class _Entry:
    """A block node (`tokens`: its block of tokens) or a prompt tail (`logits` set; `tokens`: the tokens after
    the parent's blocks, fewer than a block) with its KV rows per buffer."""

    tokens: tuple[int, ...]
    kv: list[np.ndarray]
    parent: "_Entry | None" = None
    logits: np.ndarray | None = None
    children: dict[tuple[int, ...], "_Entry"] = field(default_factory=dict)  # block nodes after this one
    tails: dict[tuple[int, ...], "_Entry"] = field(default_factory=dict)  # whole prompts ending after this one

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.kv) + (self.logits.nbytes if self.logits is not None else 0)


class PrefixCache:
    """A bounded (bytes) LRU cache of block-aligned prompt prefixes and whole prompts; see the module doc.

    `graph` names what computed the rows (the session: a different graph, thread count or dtype computes
    other bits) and `block` the block size (PREFIX_BLOCK on a row-invariant graph, else the prefill chunk);
    entries of another (graph, block) never match."""

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"a prefix cache needs a positive byte budget, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._roots: dict[tuple[Hashable, int], _Entry] = {}
        self._lru: OrderedDict[int, _Entry] = OrderedDict()  # id(entry) -> entry, least recently used first
        self.lookups = 0
        self.hits = 0  # lookups that reused rows
        self.hit_tokens = 0  # prompt rows reused
        self.evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lru)

    def lookup(self, graph: Hashable, block: int, prompt: Sequence[int], partial: bool = False) -> PrefixHit | None:
        """The longest exact reuse for `prompt`: the whole prompt (rows + last logits), else the most whole
        blocks that leave at least one token to prefill and, with `partial` (row-invariant graphs only), the
        leading rows of the entry after them that shares the most next tokens; None when nothing is cached."""
        with self._lock:
            return self._lookup(graph, block, prompt, partial)

    def whole_prompt_logits(self, graph: Hashable, block: int, prompt: Sequence[int]) -> np.ndarray | None:
        """The last logits of `prompt` when the whole prompt is cached (read-only), else None. A peek: neither
        the LRU order nor the hit counts change (a `lookup` when the prompt joins does that)."""
        prompt = tuple(int(t) for t in prompt)
        with self._lock:
            root = self._roots.get((graph, block))
            if not prompt or root is None:
                return None
            _path, tail = _walk(root, block, prompt)
            return tail.logits if tail is not None else None

    def _lookup(self, graph: Hashable, block: int, prompt: Sequence[int], partial: bool = False) -> PrefixHit | None:
        """`lookup` under the caller's lock."""
        self.lookups += 1
        prompt = tuple(int(t) for t in prompt)
        root = self._roots.get((graph, block))
        if not prompt or root is None:
            return None
        path, tail = _walk(root, block, prompt)
        shared, rows = None, 0  # an entry after the blocks, and how many of its leading rows the prompt shares
        if tail is None:
            del path[(len(prompt) - 1) // block:]  # keep a token to prefill: its pass gives the logits
            if partial:  # at most all but the last token: it is prefilled for the logits
                shared, rows = _longest_shared(path[-1] if path else root, prompt[len(path) * block: len(prompt) - 1])
        last = tail if tail is not None else shared
        if not path and last is None:
            return None
        self._touch(path, last)
        segments = [(i * block, node.kv) for i, node in enumerate(path)]
        if last is not None:
            segments.append((len(path) * block, last.kv if tail is not None else [kv[:, :rows] for kv in last.kv]))
        hit = PrefixHit(len(prompt) if tail is not None else len(path) * block + rows, segments,
                        tail.logits if tail is not None else None)
        self.hits += 1
        self.hit_tokens += hit.rows
        return hit

    def store(self, graph: Hashable, block: int, prompt: Sequence[int], arrays: Sequence[np.ndarray],
              logits: np.ndarray) -> None:
        """Keep what a prefill of `prompt` computed (on a graph that is not row-invariant: in chunks of `block`
        from position 0): its rows
        ([1, kv_heads, >= len(prompt), head_dim] per KV buffer; rows a lookup provided are bitwise the same)
        and its last logits. Entries already cached are only marked used; then the budget is enforced."""
        with self._lock:
            self._store(graph, block, prompt, arrays, logits)

    def _store(self, graph: Hashable, block: int, prompt: Sequence[int], arrays: Sequence[np.ndarray],
               logits: np.ndarray) -> None:
        """`store` under the caller's lock."""
        prompt = tuple(int(t) for t in prompt)
        whole = len(prompt) // block
        parent = self._roots.setdefault((graph, block), _Entry((), []))
        path: list[_Entry] = []
        for i in range(whole):
            key = prompt[i * block: (i + 1) * block]
            node = parent.children.get(key)
            if node is None:
                node = self._add(parent.children, _Entry(key, _rows(arrays, i * block, (i + 1) * block), parent))
                if node is None:  # larger than the whole budget
                    break
            path.append(node)
            parent = node
        tail = None
        if len(path) == whole:
            key = prompt[whole * block:]
            tail = parent.tails.get(key) or self._add(
                parent.tails, _Entry(key, _rows(arrays, whole * block, len(prompt)), parent, _frozen(logits)))
        self._touch(path, tail)
        while self.bytes > self.max_bytes:
            self._evict(next(iter(self._lru.values())))

    def clear(self) -> None:
        with self._lock:
            self._roots.clear()
            self._lru.clear()
            self.bytes = 0

    def _add(self, siblings: dict, entry: _Entry) -> _Entry | None:
        if entry.nbytes > self.max_bytes:
            return None
        siblings[entry.tokens] = entry
        self._lru[id(entry)] = entry
        self.bytes += entry.nbytes
        return entry

    def _touch(self, path: list[_Entry], tail: _Entry | None) -> None:
        """Mark used: the tail, then the blocks from the deepest up (so a parent is always used after its
        children and never evicted before them)."""
        for entry in ([tail] if tail is not None else []) + path[::-1]:
            self._lru.move_to_end(id(entry))

    def _evict(self, entry: _Entry) -> None:
        """Drop `entry` and whatever hangs below it."""
        for below in [*entry.children.values(), *entry.tails.values()]:
            self._evict(below)
        self._lru.pop(id(entry), None)
        self.bytes -= entry.nbytes
        self.evictions += 1
        parent = entry.parent
        if parent is not None:
            siblings = parent.tails if entry.logits is not None else parent.children
            siblings.pop(entry.tokens, None)


def _walk(root: _Entry, block: int, prompt: tuple[int, ...]) -> tuple[list[_Entry], _Entry | None]:
    """The block nodes the prompt's leading whole blocks match, in order, and the whole prompt's tail entry
    (None unless every whole block matched and its remaining tokens are a cached tail)."""
    node, path = root, []
    while node is not None and (len(path) + 1) * block <= len(prompt):
        start = len(path) * block
        node = node.children.get(prompt[start: start + block])
        if node is not None:
            path.append(node)
    if len(path) != len(prompt) // block:
        return path, None
    return path, (path[-1] if path else root).tails.get(prompt[len(path) * block:])


def _longest_shared(parent: _Entry, tokens: tuple[int, ...]) -> tuple[_Entry | None, int]:
    """The block or prompt tail under `parent` whose tokens begin with the longest prefix of `tokens`, and its
    length (None, 0 when no entry shares the first token)."""
    best, length = None, 0
    for entry in [*parent.children.values(), *parent.tails.values()]:
        n = 0
        for a, b in zip(entry.tokens, tokens):
            if a != b:
                break
            n += 1
        if n > length:
            best, length = entry, n
    return best, length


def _rows(arrays: Sequence[np.ndarray], start: int, stop: int) -> list[np.ndarray]:
    """Read-only copies of rows [start, stop) of every KV buffer [1, kv_heads, rows, head_dim]."""
    return [_frozen(a[0, :, start:stop]) for a in arrays]


def _frozen(array: np.ndarray) -> np.ndarray:
    """A read-only copy (what the cache hands out must never change under it)."""
    copy = np.array(array, copy=True)
    copy.setflags(write=False)
    return copy


def check_resume(reader: str | None, row_invariant: bool, prefill_chunk: int, prompt: int, cached_rows: int,
                 whole: bool) -> None:
    """Refuse a start from cached rows (or a batched prefill's logits, `whole`) that a fresh prefill would not
    reproduce bit for bit, or that leave a drafter without the prompt's hidden states (`reader`: the name of a
    drafter that reads them, else None)."""
    if reader is not None:
        raise ValueError(f"the {reader} drafter reads the prompt's hidden states: start without cached "
                         "rows or prefilled logits")
    if not cached_rows:
        return
    if whole != (cached_rows == prompt):
        raise ValueError("the prompt's last logits come with all its rows cached, and only then")
    if whole:
        return
    if cached_rows >= prompt:
        raise ValueError(f"{cached_rows} cached rows of {with_article(prompt)}-token prompt leave no token to prefill")
    if not row_invariant and cached_rows % prefill_chunk:
        raise ValueError(f"{cached_rows} cached rows of {with_article(prompt)}-token prompt: not whole prefill chunks of "
                         f"{prefill_chunk} (a fresh prefill on this graph would compute other bits)")
