"""Tree specs: ordering, masks, positions, paths, presets, JSON loading and dynamic trees."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from speccompile.draft_config import EAGLE_DEFAULT, preset_names
from speccompile.errors import InputError
from speccompile.runtime.tree import DraftTree, TreeSpec, build_dynamic_tree, grow_dynamic_tree, load_tree

CHOICES = [[0], [0, 0], [1], [0, 1], [2]]
# sorted by (depth, path): 1=[0] 2=[1] 3=[2] 4=[0,0] 5=[0,1]


def test_from_choices_orders_by_depth_then_path():
    tree = TreeSpec.from_choices(CHOICES)
    assert len(tree) == tree.n == 6
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1]
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2]
    assert tree.choice.tolist() == [0, 0, 1, 2, 0, 1]
    assert tree.children == [[1, 2, 3], [4, 5], [], [], [], []]
    assert tree.choices() == [[0], [1], [2], [0, 0], [0, 1]]
    assert tree.max_depth == 2 and not tree.is_chain


def test_root_path_is_implicit_and_input_order_is_irrelevant():
    a = TreeSpec.from_choices(CHOICES)
    b = TreeSpec.from_choices([[], [2], [0, 1], [1], [0, 0], [0]])
    assert a == b and hash(a) == hash(b)


def test_attention_mask_hand_checked():
    tree = TreeSpec.from_choices(CHOICES)
    want_tree_part = np.array(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 0, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 1, 0, 0, 0, 1],
        ],
        dtype=bool,
    )
    mask = tree.attention_mask(past_len=2)
    assert mask.dtype == bool and mask.shape == (6, 8)
    assert mask[:, :2].all()
    np.testing.assert_array_equal(mask[:, 2:], want_tree_part)
    np.testing.assert_array_equal(tree.attention_mask(), want_tree_part)


def test_position_ids_are_past_plus_depth():
    tree = TreeSpec.from_choices(CHOICES)
    pos = tree.position_ids(past_len=3)
    assert pos.dtype == np.int64
    assert pos.tolist() == [3, 4, 4, 4, 5, 5]


def test_paths_and_ancestors():
    tree = TreeSpec.from_choices(CHOICES)
    assert tree.leaves() == [2, 3, 4, 5]
    assert tree.paths() == [[0, 2], [0, 3], [0, 1, 4], [0, 1, 5]]
    assert tree.ancestors(5) == [0, 1]
    assert tree.ancestors(5, include_self=True) == [0, 1, 5]
    assert tree.ancestors(0) == []


def test_chain_is_lower_triangular():
    tree = TreeSpec.chain(4)
    assert len(tree) == 5 and tree.is_chain and tree.max_depth == 4
    np.testing.assert_array_equal(tree.attention_mask(), np.tril(np.ones((5, 5), dtype=bool)))
    assert tree.paths() == [[0, 1, 2, 3, 4]]
    assert tree == TreeSpec.from_choices([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    assert len(TreeSpec.chain(0)) == 1


def test_from_parents_builds_any_topological_tree():
    tree = TreeSpec.from_parents([-1, 0, 0, 1, 2, 1])
    assert tree.choice.tolist() == [0, 0, 1, 0, 0, 1]
    assert tree.children == [[1, 2], [3, 5], [4], [], [], []]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2]
    assert tree.attention_mask()[5].tolist() == [True, True, False, False, False, True]
    explicit = TreeSpec.from_parents([-1, 0, 0], choice=[0, 1, 0])
    assert explicit.children == [[2, 1], [], []]
    for bad in ([0, 0], [-1, 1], [-1, 0, 3], []):
        with pytest.raises(ValueError):
            TreeSpec.from_parents(bad)


def test_arrays_are_read_only():
    tree = TreeSpec.chain(2)
    with pytest.raises(ValueError):
        tree.parents[1] = 0


@pytest.mark.parametrize(
    "choices, message",
    [
        ([[0], [1, 0]], "tree path [1, 0] has no parent path [1]"),
        ([[0], [0]], "appears twice"),
        ([[0], [-1]], "non-negative integers"),
        ([[0], ["a"]], "non-negative integers"),
        ([[0], [True]], "non-negative integers"),
        ([0, 1], "non-negative integers"),
        ("[[0]]", "list of paths"),
    ],
)
def test_bad_choices_raise_input_error(choices, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TreeSpec.from_choices(choices)


# --------------------------------------------------------------------------------------------
# Presets and load_tree
# --------------------------------------------------------------------------------------------


def test_presets():
    assert {"chain-4", "chain-8", "tree-2x4", "eagle-default"} <= set(preset_names())
    assert load_tree("chain-4") == TreeSpec.chain(4)
    assert load_tree("chain-8") == TreeSpec.chain(8)
    t = load_tree("tree-2x4")
    assert len(t) == 9 and t.max_depth == 4 and t.children[0] == [1, 2]
    assert len(load_tree("tree-3x2")) == 7  # patterns work for other sizes
    assert load_tree("chain-3") == TreeSpec.chain(3)


def test_eagle_default_shape():
    tree = load_tree("eagle-default")
    assert len(tree) == 25 and tree.max_depth == 5
    widths = np.bincount(tree.depths)[1:].tolist()
    assert widths == [4, 7, 6, 4, 3]
    assert tree.choices() == sorted(EAGLE_DEFAULT, key=lambda p: (len(p), p))


def test_load_tree_from_json(tmp_path):
    f = tmp_path / "tree.json"
    f.write_text(json.dumps(CHOICES))
    assert load_tree(str(f)) == TreeSpec.from_choices(CHOICES)
    g = tmp_path / "tree2.json"
    g.write_text(json.dumps({"choices": CHOICES}))
    assert load_tree(g) == TreeSpec.from_choices(CHOICES)


@pytest.mark.parametrize(
    "content, message",
    [
        ("[[0], [0, 0", "not valid JSON"),
        ('{"nodes": [[0]]}', "must hold a list of choice paths"),
        ("[[0], [2, 1]]", "has no parent path"),
        ('[[0], ["x"]]', "non-negative integers"),
    ],
)
def test_load_tree_bad_json(tmp_path, content, message):
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(InputError, match=message) as err:
        load_tree(str(f))
    assert "\n" not in str(err.value)


def test_load_tree_unknown_preset_and_missing_file():
    with pytest.raises(InputError, match="unknown tree preset 'medusa-63'.*eagle-default"):
        load_tree("medusa-63")
    with pytest.raises(InputError, match="not found"):
        load_tree("/nonexistent/tree.json")
    with pytest.raises(InputError, match="between 1 and"):
        load_tree("chain-0")
    with pytest.raises(InputError, match="between 1 and"):
        load_tree("tree-100x100")


# --------------------------------------------------------------------------------------------
# Dynamic trees (EAGLE-2)
# --------------------------------------------------------------------------------------------


class TableDrafter:
    """expand() from a fixed table: node id -> (tokens, probabilities); records its calls."""

    def __init__(self, table: dict[int, tuple[list[int], list[float]]]) -> None:
        self.table = table
        self.calls: list[tuple[list[int], int]] = []

    def __call__(self, frontier: np.ndarray, tree: DraftTree):
        self.calls.append((frontier.tolist(), len(tree)))
        toks = [self.table[i][0] for i in frontier]
        logp = [[math.log(x) for x in self.table[i][1]] for i in frontier]
        return np.array(toks), np.array(logp)


# Hand-checked example, top_k = 2. Creation ids and cumulative probabilities:
#   root 0 (token 100) -> 1: token 10 (.6), 2: token 11 (.35)
#   1 -> 3: token 20 (.6*.5 = .30), 4: token 21 (.6*.4 = .24)
#   2 -> 5: token 22 (.35*.9 = .315), 6: token 23 (.35*.05 = .0175)
#   step 3 expands the best two of {3, 4, 5, 6}: 5 (.315) then 3 (.30)
#   5 -> 7: token 30 (.315*.8 = .252), 8: token 31 (.315*.1)
#   3 -> 9: token 32 (.30*.7 = .21), 10: token 33 (.30*.2)
TABLE = {
    0: ([10, 11], [0.6, 0.35]),
    1: ([20, 21], [0.5, 0.4]),
    2: ([22, 23], [0.9, 0.05]),
    5: ([30, 31], [0.8, 0.1]),
    3: ([32, 33], [0.7, 0.2]),
}


def test_dynamic_tree_hand_checked():
    drafter = TableDrafter(TABLE)
    tree, tokens = build_dynamic_tree(drafter, depth=2, top_k=2, total_tokens=3, root_token=100)
    assert drafter.calls == [([0], 1), ([1, 2], 3)]
    # best three: 1 (.6), 2 (.35), 5 (.315); re-indexed by (depth, path): [0], [1], [1, 0]
    assert tokens.tolist() == [100, 10, 11, 22]
    assert tree.parents.tolist() == [-1, 0, 0, 2]
    assert tree.choice.tolist() == [0, 0, 1, 0]

    tree, tokens = build_dynamic_tree(TableDrafter(TABLE), depth=2, top_k=2, total_tokens=4, root_token=100)
    assert tokens.tolist() == [100, 10, 11, 20, 22]  # adds node 3 (.30) as path [0, 0]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2]


def test_dynamic_tree_third_step_expands_best_frontier():
    drafter = TableDrafter(TABLE)
    tree, tokens = build_dynamic_tree(drafter, depth=3, top_k=2, total_tokens=6, root_token=100)
    assert drafter.calls == [([0], 1), ([1, 2], 3), ([5, 3], 7)]
    # best six: 1 .6, 2 .35, 5 .315, 3 .30, 7 .252, 4 .24
    # order by (depth, path): [0]=10 [1]=11 [0,0]=20 [0,1]=21 [1,0]=22 [1,0,0]=30
    assert tokens.tolist() == [100, 10, 11, 20, 21, 22, 30]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 2, 5]
    assert tree.position_ids(10).tolist() == [10, 11, 11, 12, 12, 12, 13]


def test_confidence_bound_dynamic_tree_stops_and_prunes():
    drafter = TableDrafter(TABLE)
    tree, tokens = build_dynamic_tree(drafter, depth=4, top_k=2, total_tokens=10, root_token=100, min_prob=0.31)
    # step 2 keeps only node 5 (.315) on the frontier; its children (.252, .0315) fall below .31: growth stops
    assert drafter.calls == [([0], 1), ([1, 2], 3), ([5], 7)]
    assert tokens.tolist() == [100, 10, 11, 22]  # nodes 1 (.6), 2 (.35), 5 (.315)
    assert tree.parents.tolist() == [-1, 0, 0, 2]
    drafter = TableDrafter(TABLE)
    tree, tokens = build_dynamic_tree(drafter, depth=4, top_k=2, total_tokens=10, root_token=100, min_prob=0.7)
    assert drafter.calls == [([0], 1)] and tokens.tolist() == [100] and tree.n == 1  # unsure: no draft
    # min_prob 0 is the plain EAGLE-2 tree
    assert build_dynamic_tree(TableDrafter(TABLE), depth=2, top_k=2, total_tokens=3, root_token=100, min_prob=0.0)[1].tolist() == [100, 10, 11, 22]


def test_dynamic_tree_children_ids_are_predictable():
    seen = []

    def expand(frontier, tree):
        n0 = len(tree)
        seen.append((frontier.tolist(), n0))
        m = len(frontier)
        toks = np.arange(m * 3).reshape(m, 3) + 100 * len(seen)
        return toks, np.log(np.tile([0.5, 0.3, 0.2], (m, 1)))

    tree, calls = grow_dynamic_tree(expand, depth=2, top_k=2, root_token=7)
    assert calls == 2
    # children of frontier[r] at rank j get id n0 + r * top_k + j
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 2]
    assert tree.tokens == [7, 100, 101, 200, 201, 203, 204]
    assert tree.ancestors(5, include_self=True) == [0, 2, 5]
    spec = tree.spec()
    assert spec.parents.tolist() == tree.parents


def test_dynamic_tree_sorts_rows_and_keeps_ties_ancestor_closed():
    # all log-probs 0 (probability 1): every node ties; shallower nodes must win
    def expand(frontier, tree):
        m = len(frontier)
        return np.tile([5, 6], (m, 1)), np.zeros((m, 2))

    tree, tokens = build_dynamic_tree(expand, depth=3, top_k=2, total_tokens=3, root_token=1)
    assert tree.depths.tolist() == [0, 1, 1, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1]

    # unsorted rows: the higher log-prob becomes rank 0
    def expand_unsorted(frontier, tree):
        m = len(frontier)
        return np.tile([5, 6, 7], (m, 1)), np.log(np.tile([0.1, 0.6, 0.3], (m, 1)))

    tree, tokens = build_dynamic_tree(expand_unsorted, depth=1, top_k=2, total_tokens=2, root_token=1)
    assert tokens.tolist() == [1, 6, 7]


def test_dynamic_tree_with_positive_log_probs_stays_ancestor_closed():
    # a child scoring above its parent (bad drafter numerics) must not be kept without it
    table = {0: ([1, 2], [0.5, 0.4]), 1: ([3, 4], [0.9, 0.1]), 2: ([5, 6], [3.0, 0.1])}
    # raw scores: 1 .5, 2 .4, 3 .45, 4 .05, 5 1.2 (capped to its parent's .4), 6 .04
    grown = {}
    for total, want in [(2, [0, 1, 3]), (3, [0, 1, 2, 3]), (4, [0, 1, 2, 3, 5])]:
        tree, tokens = build_dynamic_tree(TableDrafter(table), depth=2, top_k=2, total_tokens=total, root_token=0)
        assert tokens.tolist() == want
        grown[total] = tree
    assert grown[4].parents.tolist() == [-1, 0, 0, 1, 2]


def test_dynamic_tree_edge_cases():
    tree, tokens = build_dynamic_tree(TableDrafter(TABLE), depth=0, top_k=2, total_tokens=5, root_token=100)
    assert len(tree) == 1 and tokens.tolist() == [100]
    tree, tokens = build_dynamic_tree(TableDrafter(TABLE), depth=2, top_k=2, total_tokens=0, root_token=100)
    assert len(tree) == 1
    tree, tokens = build_dynamic_tree(TableDrafter(TABLE), depth=2, top_k=2, total_tokens=100, root_token=100)
    assert len(tree) == 7  # everything grown
    with pytest.raises(ValueError, match="shape"):
        build_dynamic_tree(lambda f, t: (np.zeros((1, 1)), np.zeros((1, 1))), 1, 2, 4, 0)
    with pytest.raises(ValueError, match="top_k"):
        build_dynamic_tree(TableDrafter(TABLE), 1, 0, 4, 0)
