"""A depth-limited, path-compressed suffix tree over many token sequences, with counts: SuffixDecoding's index.

Every suffix of every sequence is stored up to `max_depth` tokens; a node's `count` is the number of stored
suffixes that pass through or end at it, so count(child) / count(node) estimates how often the child's token
follows the node's path. Edges are compressed: a node holds the tokens of its edge as a slice (`start`,
`length`) of one sequence that spells the node's whole path (`ref`, the sequence's token array itself, so a
removed sequence's tokens live on exactly as long as a node still points into them).

Invariant: a suffix always ends at a node's end (never inside an edge). Appending a token to a sequence
extends its at most `max_depth` unfinished suffixes (their end nodes, `_Sequence.ends`) by one token each:
O(max_depth) dictionary operations per token, independent of how much the tree holds. Removing a sequence
walks each of its suffixes once, decrementing counts and dropping nodes that no suffix reaches.

`speculate` follows SuffixDecoding (Oliaro et al., 2024; Arctic Inference 0.3.0): the context's last tokens are
matched for every match length below `max_depth` (and below the context's length); from each match a draft tree is grown best-first by the
estimated path probability (product of count ratios), keeping nodes of probability >= `min_token_prob`, at
most min(`max_tokens`, `max_spec_factor` x match length + `max_spec_offset`) of them; the draft whose summed
probabilities (`score`, expected accepted tokens) is highest wins, the longest match on ties.
"""

from __future__ import annotations

import heapq
import sys
from array import array
from dataclasses import dataclass, field
from typing import Sequence


class _Node:
    """A tree node: the edge into it is `ref[start: start + length]`; `children` by their edge's first token."""

    __slots__ = ("parent", "children", "count", "ref", "start", "length")

    def __init__(self, parent: "_Node | None", ref: array | None, start: int, length: int, count: int):
        self.parent = parent
        self.children: dict[int, _Node] | None = None
        self.count = count
        self.ref = ref
        self.start = start
        self.length = length

    @property
    def token(self) -> int:
        """The first token of the edge into this node."""
        return self.ref[self.start]

    def child(self, token: int) -> "_Node | None":
        return None if self.children is None else self.children.get(token)

    def adopt(self, child: "_Node") -> None:
        if self.children is None:
            self.children = {}
        self.children[child.token] = child
        child.parent = self

    def only_child(self) -> "_Node | None":
        return next(iter(self.children.values())) if self.children is not None and len(self.children) == 1 else None


@dataclass
class _Sequence:
    tokens: array = field(default_factory=lambda: array("i"))
    ends: list[_Node] = field(default_factory=list)  # end nodes of the unfinished suffixes, longest first


@dataclass
class Candidate:
    """A speculated draft tree: `tokens[i]` hangs below `tokens[parents[i]]` (-1: below the context's last token),
    parents first; `probs[i]` its estimated probability; `score` their sum; `match_len` the matched context length."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Suffixes (up to `max_depth` tokens) of sequences identified by hashable ids; see the module docstring."""

    def __init__(self, max_depth: int = 24):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = int(max_depth)
        self.root = _Node(None, None, 0, 0, 0)
        self._seqs: dict[object, _Sequence] = {}

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        """Sequences held."""
        return len(self._seqs)

    @property
    def tokens(self) -> int:
        """Tokens held, over all sequences (= the root's count)."""
        return self.root.count

    def extend(self, seq_id: object, tokens: Sequence[int]) -> None:
        """Append `tokens` to sequence `seq_id` (a new one when unknown)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _Sequence()
        for token in tokens:
            self._append(seq, int(token))

    def _append(self, seq: _Sequence, token: int) -> None:
        seq.tokens.append(token)
        position = len(seq.tokens) - 1
        ends = seq.ends
        ends.append(self.root)  # the new suffix, empty so far
        self.root.count += 1
        if len(ends) > self.max_depth:
            del ends[0]  # that suffix is max_depth tokens long: complete
        for i, node in enumerate(ends):
            ends[i] = self._extend_suffix(node, seq.tokens, position, token)

    def _extend_suffix(self, node: _Node, tokens: array, position: int, token: int) -> _Node:
        """The end node of a suffix that ended at `node`'s end, after `token` (at `position` of `tokens`)."""
        root = self.root
        child = node.child(token)
        if child is None:
            if node is not root and node.count == 1:  # only this suffix reaches the leaf: lengthen it
                node.length += 1
                node.ref, node.start = tokens, position + 1 - node.length
                return node
            leaf = _Node(node, tokens, position, 1, 1)
            node.adopt(leaf)
            return leaf
        if node is not root and node.count == child.count + 1:
            # this suffix is the only one ending at `node` and every other one goes on into `child`
            if child.length == 1:  # fuse: `child` takes `node`'s place, one token longer
                child.count += 1
                child.length = node.length + 1
                child.ref, child.start = tokens, position + 1 - child.length
                parent = node.parent
                del parent.children[child.token]
                parent.adopt(child)
                return child
            del node.children[token]  # move the boundary one token down into `child`
            node.length += 1
            node.ref, node.start = tokens, position + 1 - node.length
            child.start += 1
            child.length -= 1
            node.adopt(child)
            return node
        if child.length == 1:
            child.count += 1
            child.ref, child.start = tokens, position
            return child
        middle = _Node(node, tokens, position, 1, child.count + 1)  # split `child` after its first token
        del node.children[token]
        node.adopt(middle)
        child.start += 1
        child.length -= 1
        middle.adopt(child)
        return middle

    def remove(self, seq_id: object) -> None:
        """Forget sequence `seq_id` (KeyError when unknown)."""
        tokens = self._seqs.pop(seq_id).tokens
        for start in range(len(tokens)):
            self._remove_suffix(tokens, start, min(len(tokens), start + self.max_depth))

    def _remove_suffix(self, tokens: array, start: int, end: int) -> None:
        node = self.root
        node.count -= 1
        at = start
        while at < end:
            child = node.children[tokens[at]]
            child.count -= 1
            if child.count == 0:
                del node.children[tokens[at]]
                break
            at += child.length
            node = child
        only = node.only_child() if node is not self.root else None
        if only is not None and only.count == node.count:  # no suffix ends at `node` any more: fuse it into its child
            only.start -= node.length
            only.length += node.length
            parent = node.parent
            del parent.children[only.ref[only.start]]
            parent.adopt(only)

    # -- speculation ----------------------------------------------------------------------------------

    def match(self, pattern: Sequence[int]) -> tuple[_Node, int] | None:
        """Where `pattern` ends in the tree: (node, tokens of its edge matched), None when it does not occur."""
        node, used = self.root, 0
        for token in pattern:
            if used == node.length:
                children = node.children
                node = children.get(token) if children is not None else None
                if node is None:
                    return None
                used = 1  # the child is keyed by its edge's first token
                continue
            if node.ref[node.start + used] != token:
                return None
            used += 1
        return node, used

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1, tree: bool = True) -> Candidate:
        """The best draft after `context` (module docstring); an empty Candidate when nothing matches."""
        best = Candidate()
        context = list(context[-self.max_depth:])
        grow = _grow_tree if tree else _grow_path
        for match_len in range(self._longest_match(context), 0, -1):  # longest first: it wins ties
            budget = max(0, min(max_tokens, int(match_len * max_spec_factor + max_spec_offset + 1e-6)))
            if budget <= best.score:  # shorter matches draft no more tokens: none can score higher
                break
            found = self.match(context[-match_len:])
            candidate = grow(found[0], found[1], budget, min_token_prob)
            if candidate.score > best.score:
                best = candidate
                best.match_len = match_len
        return best

    def _longest_match(self, context: list[int]) -> int:
        """The longest m < len(context) whose last m tokens occur in the tree (binary search: every shorter
        suffix of an occurring one occurs too)."""
        low, high = 0, len(context) - 1
        while low < high:
            middle = (low + high + 1) // 2
            if self.match(context[-middle:]) is not None:
                low = middle
            else:
                high = middle - 1
        return low

    def memory_bytes(self) -> int:
        """An estimate of the bytes this tree holds: nodes, child tables, sequences (tokens and suffix ends)."""
        total, stack, refs = sys.getsizeof(self), [self.root], {}
        node_size = sys.getsizeof(self.root)
        while stack:
            node = stack.pop()
            total += node_size
            if node.children is not None:
                total += sys.getsizeof(node.children)
                stack.extend(node.children.values())
            if node.ref is not None:
                refs[id(node.ref)] = node.ref
        for seq in self._seqs.values():
            refs[id(seq.tokens)] = seq.tokens
            total += sys.getsizeof(seq.ends)
        total += sum(sys.getsizeof(tokens) for tokens in refs.values())
        return total


def _edge_token(node: _Node, used: int) -> int:
    return node.ref[node.start + used]


def _grow_path(node: _Node, used: int, budget: int, min_prob: float) -> Candidate:
    """A chain: the most frequent continuation at every branch, while its probability stays >= min_prob."""
    out, prob = Candidate(), 1.0
    while len(out.tokens) < budget:
        if used < node.length:
            out.parents.append(len(out.tokens) - 1)
            out.tokens.append(_edge_token(node, used))
            out.probs.append(prob)
            out.score += prob
            used += 1
            continue
        if not node.children:
            break
        child = max(node.children.values(), key=lambda c: c.count)  # the first of equals
        prob *= child.count / node.count
        if prob < min_prob:
            break
        node, used = child, 0
    return out


def _grow_tree(node: _Node, used: int, budget: int, min_prob: float) -> Candidate:
    """A tree: nodes taken best-first by estimated probability (product of count ratios down the path)."""
    out = Candidate()
    order = 0  # ties: first pushed first
    heap: list[tuple[float, int, _Node, int, int]] = [(-1.0, order, node, used, -1)]
    while heap and len(out.tokens) < budget:
        negative, _, node, used, parent = heapq.heappop(heap)
        prob = -negative
        if used < node.length:
            out.tokens.append(_edge_token(node, used))
            out.parents.append(parent)
            out.probs.append(prob)
            out.score += prob
            order += 1
            heapq.heappush(heap, (negative, order, node, used + 1, len(out.tokens) - 1))
            continue
        for child in (node.children or {}).values():
            child_prob = prob * child.count / node.count
            if child_prob >= min_prob:
                order += 1
                heapq.heappush(heap, (-child_prob, order, child, 0, parent))
    return out
