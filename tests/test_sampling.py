"""Logits processing, sampling, and the exactness of chain/tree verification.

The distribution tests follow docs/DESIGN.md ("Exact speculative sampling"): a synthetic Markov
"model" over a vocabulary of 8 tokens (fixed random transition tables for the target p and the drafter q), N = 100,000
speculative generations of the first 3 tokens with a fixed seed, and a chi-square test of the
empirical joint distribution against the exact target joint. Each test calls the real
``verify_chain`` / ``verify_tree`` once per speculation round; only the synthetic drafter's
proposals are pre-drawn in bulk (they are test scaffolding, not the code under test).

The chi-square survival function is computed here (scipy is not a dependency) from the
regularized upper incomplete gamma function Q(df/2, x/2): a power series below a + 1 and a
continued fraction above it.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import pytest

from speccompile.errors import InputError
from speccompile.runtime.sampling import SamplingParams, process_logits, sample
from speccompile.runtime.verification import ChainResult, TreeResult, verify_chain, verify_tree
from speccompile.runtime.tree import TreeSpec, build_dynamic_tree

V = 8  # synthetic vocabulary
T = 3  # length of the generated prefix whose joint distribution is tested
ROOT = 3  # the last committed token before generation starts
N = 100_000  # generations per distribution test
MIN_P_VALUE = 1e-3


# --------------------------------------------------------------------------------------------
# Chi-square machinery
# --------------------------------------------------------------------------------------------


def _upper_gamma_regularized(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a) for a > 0, x >= 0."""
    if x <= 0:
        return 1.0
    log_prefactor = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for the lower function P(a, x)
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / (a + n)
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    tiny = 1e-300  # modified Lentz continued fraction for Q(a, x)
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            break
    return math.exp(log_prefactor) * h


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square with df degrees of freedom."""
    return _upper_gamma_regularized(df / 2.0, x / 2.0)


def chi_square_p_value(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness-of-fit p-value of ``counts`` against ``probs``.

    Cells whose expected count is below ``min_expected`` are pooled into one cell; any count
    in a zero-probability cell gives p-value 0.
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if np.any(counts[probs == 0] > 0):
        return 0.0
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs_a, exp_a = np.array(obs), np.array(exp)
    stat = float(((obs_a - exp_a) ** 2 / exp_a).sum())
    return chi2_sf(stat, len(obs_a) - 1)


def test_chi2_sf_matches_known_values():
    for x in (0.1, 1.0, 3.0, 10.0, 40.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-10)
        assert chi2_sf(x, 1) == pytest.approx(math.erfc(math.sqrt(x / 2)), rel=1e-9)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(124.34211340400407, 100) == pytest.approx(0.05, rel=1e-8)
    assert chi2_sf(0.0, 5) == 1.0


# --------------------------------------------------------------------------------------------
# The synthetic model
# --------------------------------------------------------------------------------------------


def model_logits(seed: int = 0, agreement: float = 0.8) -> tuple[np.ndarray, np.ndarray]:
    """Target and draft logit tables [V, V] (row = previous token); the draft is correlated."""
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(V, V)) * 1.5
    draft = agreement * target + (1 - agreement) * rng.normal(size=(V, V)) * 1.5
    return target, draft


def exact_joint(p_table: np.ndarray, root: int = ROOT, length: int = T) -> np.ndarray:
    """Exact probability of every continuation of ``length`` tokens: shape [V] * length."""
    joint = p_table[root]
    for _ in range(length - 1):
        joint = joint[..., None] * p_table
    return joint


def encode(tokens: list[int]) -> int:
    code = 0
    for t in tokens[:T]:
        code = code * V + t
    return code


def predraw_chains(q_table: np.ndarray, k: int, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Draft chains x_1..x_k ~ q for every start token: int array [*shape, V, k]."""
    flat = int(np.prod(shape)) * V
    prev = np.tile(np.arange(V), flat // V)
    out = np.empty((flat, k), dtype=np.int8)
    cdf = np.cumsum(q_table, axis=1)
    for j in range(k):
        u = rng.random(flat) * cdf[prev, -1]
        nxt = (u[:, None] >= cdf[prev]).sum(axis=1)  # inverse CDF: cdf[i-1] <= u < cdf[i]
        assert np.all(q_table[prev, nxt] > 0)
        out[:, j] = prev = nxt
    return out.reshape(*shape, V, k)


def tables(p_params: SamplingParams, q_params: SamplingParams, same: bool = False, seed: int = 0):
    target, draft = model_logits(seed)
    p = process_logits(target, p_params)
    q = process_logits(target if same else draft, q_params)
    return p, q


# --------------------------------------------------------------------------------------------
# Speculative generation with the real verifiers
# --------------------------------------------------------------------------------------------

ChainVerifier = Callable[..., ChainResult]


def run_chain(
    p: np.ndarray,
    q: np.ndarray,
    *,
    k: int,
    soft: bool,
    seed: int,
    n: int = N,
    verify: ChainVerifier = verify_chain,
) -> np.ndarray:
    """Counts [V**T] of the first T tokens of n speculative generations with chain drafts.

    soft: drafts are drawn from q (draft_probs passed); otherwise the drafter is its argmax.
    """
    rng = np.random.default_rng(seed)
    if soft:
        drafts = predraw_chains(q, k, (n, T), rng)
    else:
        greedy = [[int(t)] for t in q.argmax(axis=1)]
        for _ in range(k - 1):
            greedy = [chain + [int(q[chain[-1]].argmax())] for chain in greedy]
    ctx_p = {}  # stacked target rows per context, built on first use
    ctx_q = {}
    codes = np.empty(n, dtype=np.int64)
    for s in range(n):
        out: list[int] = []
        last = ROOT
        rnd = 0
        while len(out) < T:
            xs = drafts[s, rnd, last].tolist() if soft else greedy[last]
            key = (last, *xs)
            rows = ctx_p.get(key)
            if rows is None:
                rows = ctx_p[key] = p[list(key)]
                ctx_q[key] = q[list(key[:-1])]
            res = verify(xs, rows, rng, ctx_q[key] if soft else None)
            out += res.tokens
            last = out[-1]
            rnd += 1
        codes[s] = encode(out)
    return np.bincount(codes, minlength=V**T)


def draft_tree_tokens(tree: TreeSpec, q: np.ndarray, root: int) -> list[int]:
    """Deterministic drafter: the children of a node are its top-k tokens under q, by rank."""
    order = np.argsort(-q, axis=1, kind="stable")
    tokens = [root]
    for i in range(1, len(tree)):
        tokens.append(int(order[tokens[tree.parents[i]], tree.choice[i]]))
    return tokens


def run_tree_deterministic(p: np.ndarray, make_tree: Callable[[int], tuple[TreeSpec, list[int]]], seed: int, n: int = N):
    """Counts of the first T tokens; ``make_tree(last)`` gives the (deterministic) draft tree."""
    rng = np.random.default_rng(seed)
    cache = {}
    codes = np.empty(n, dtype=np.int64)
    for s in range(n):
        out: list[int] = []
        last = ROOT
        while len(out) < T:
            if last not in cache:
                tree, toks = make_tree(last)
                cache[last] = (tree, toks, p[toks])
            tree, toks, rows = cache[last]
            res = verify_tree(tree, toks, rows, rng)
            out += res.tokens
            last = out[-1]
        codes[s] = encode(out)
    return np.bincount(codes, minlength=V**T)


def draw_iid_trees(tree: TreeSpec, q: np.ndarray, roots: np.ndarray, replace: bool, rng) -> np.ndarray:
    """Node tokens [m, n] of m trees whose children are drawn from q of their parent's token.

    With replacement: independent inverse-CDF draws. Without: Gumbel-top-k, which orders the
    tokens exactly like successive draws without replacement.
    """
    toks = np.empty((len(roots), len(tree)), dtype=np.int64)
    toks[:, 0] = roots
    cdf = np.cumsum(q, axis=1)
    log_q = np.log(np.where(q > 0, q, 1.0)) + np.where(q > 0, 0.0, -np.inf)
    for u, kids in enumerate(tree.children):
        if not kids:
            continue
        parent_tok = toks[:, u]
        if replace:
            for c in kids:
                uni = rng.random(len(roots)) * cdf[parent_tok, -1]
                toks[:, c] = (uni[:, None] >= cdf[parent_tok]).sum(axis=1)
        else:
            keys = log_q[parent_tok] + rng.gumbel(size=(len(roots), V))
            toks[:, kids] = np.argsort(-keys, axis=1)[:, : len(kids)]
    assert np.all(q[toks[:, tree.parents[1:]], toks[:, 1:]] > 0)
    return toks


def run_tree_iid(p: np.ndarray, q: np.ndarray, tree: TreeSpec, *, replace: bool, seed: int, n: int = N):
    """Counts of the first T tokens with children drawn from q (with or without replacement).

    Generations advance in lockstep: one round's trees are drawn for all unfinished samples
    at once, then ``verify_tree`` runs once per sample.
    """
    rng = np.random.default_rng(seed)
    mode = "iid" if replace else "iid_without_replacement"
    outs: list[list[int]] = [[] for _ in range(n)]
    active = list(range(n))
    last = [ROOT] * n
    while active:
        toks = draw_iid_trees(tree, q, np.array([last[s] for s in active]), replace, rng)
        p_rows, q_rows, tok_lists = p[toks], q[toks], toks.tolist()
        still = []
        for j, s in enumerate(active):
            res = verify_tree(tree, tok_lists[j], p_rows[j], rng, child_probs=q_rows[j], mode=mode)
            outs[s] += res.tokens
            last[s] = outs[s][-1]
            if len(outs[s]) < T:
                still.append(s)
        active = still
    return np.bincount([encode(o) for o in outs], minlength=V**T)


def assert_exact(counts: np.ndarray, p: np.ndarray) -> None:
    pv = chi_square_p_value(counts, exact_joint(p))
    assert pv > MIN_P_VALUE, f"chi-square p-value {pv:.3g}: output is not distributed as the target"


# --------------------------------------------------------------------------------------------
# Distribution tests
# --------------------------------------------------------------------------------------------

T1 = SamplingParams(temperature=1.0)

CHAIN_CASES = {
    "one-hot q": (SamplingParams(0.8, top_k=6, top_p=0.95), T1, False, False, 2),
    "soft q": (T1, T1, True, False, 2),
    "temperature, k=3": (SamplingParams(0.6), SamplingParams(1.4), True, False, 3),
    "top-k (p has zeros)": (SamplingParams(1.0, top_k=3), T1, True, False, 2),
    "top-p": (SamplingParams(0.9, top_p=0.7), SamplingParams(1.0, top_p=0.9), True, False, 2),
    "p == q": (SamplingParams(0.8), SamplingParams(0.8), True, True, 2),
    "q has zeros": (T1, SamplingParams(1.0, top_k=2), True, False, 2),
}


@pytest.mark.parametrize("case", list(CHAIN_CASES))
def test_chain_is_exact(case):
    p_params, q_params, soft, same, k = CHAIN_CASES[case]
    p, q = tables(p_params, q_params, same=same)
    counts = run_chain(p, q, k=k, soft=soft, seed=1234 + len(case))
    assert_exact(counts, p)


def test_tree_deterministic_children_is_exact():
    # top-k on the target: some children (top-k of the drafter) have p = 0
    p, q = tables(SamplingParams(0.8, top_k=5), SamplingParams(1.2))
    tree = TreeSpec.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    counts = run_tree_deterministic(p, lambda r: (tree, draft_tree_tokens(tree, q, r)), seed=8)
    assert_exact(counts, p)


def run_tree_cut_and_carry(p: np.ndarray, tree: TreeSpec, q: np.ndarray, seed: int, n: int = N, cut: bool = True):
    """Counts of the first T tokens when only the main path's rows are exact (the others get another
    context's distribution, as a row computed with a masked hole before it might): each verdict is cut at the
    first accepted node off the main path (`exact_acceptance`) and what it chose past the cut is the next
    round's draft, a one-hot chain verified on exact rows (runtime/generate.py). `cut=False`: the verdict is
    used as computed (the negative control)."""
    from speccompile.runtime.backends.tree_layout import main_path_first
    from speccompile.runtime.verification import exact_acceptance

    rng = np.random.default_rng(seed)
    _order, exact = main_path_first(tree.ancestry)
    codes = np.empty(n, dtype=np.int64)
    for s in range(n):
        out: list[int] = []
        last, carried = ROOT, []
        while len(out) < T:
            if carried:
                res = verify_chain(carried, p[[last, *carried]], rng, None)
                emitted, carried = res.tokens, []
            else:
                toks = draft_tree_tokens(tree, q, last)
                rows = np.where(exact[:, None], p[toks], p[(np.asarray(toks) + 1) % V])
                verdict = verify_tree(tree, toks, rows, rng)
                emitted = verdict.tokens
                if cut:
                    _rows, emitted = exact_acceptance(verdict.path, verdict.tokens, exact)
                    carried = verdict.tokens[len(emitted):]
            out += emitted
            last = out[-1]
        codes[s] = encode(out)
    return np.bincount(codes, minlength=V**T)


def test_tree_cut_and_carry_is_exact():
    """The rule that makes trees exact where only the main path's rows are plain decoding's keeps the
    target distribution; without the cut, the off-path rows' wrong distributions show."""
    p, q = tables(SamplingParams(0.9), SamplingParams(1.1))
    tree = TreeSpec.from_choices([[0], [1], [0, 0], [1, 0], [0, 0, 0], [1, 0, 0]])
    assert_exact(run_tree_cut_and_carry(p, tree, q, seed=21), p)
    wrong = run_tree_cut_and_carry(p, tree, q, seed=22, n=20_000, cut=False)
    assert chi_square_p_value(wrong, exact_joint(p)) < 1e-6


def test_dynamic_tree_is_exact():
    p, q = tables(SamplingParams(0.9), T1)
    log_q = np.log(q)
    order = np.argsort(-q, axis=1, kind="stable")

    def make_tree(root: int):
        def expand(frontier, tree):
            toks = [tree.tokens[i] for i in frontier]
            return order[toks], np.take_along_axis(log_q[toks], order[toks], axis=1)

        spec, toks = build_dynamic_tree(expand, depth=3, top_k=2, total_tokens=5, root_token=root)
        return spec, [int(t) for t in toks]

    counts = run_tree_deterministic(p, make_tree, seed=9)
    assert_exact(counts, p)


IID_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 0]]


@pytest.mark.parametrize("replace", [True, False], ids=["with-replacement", "without-replacement"])
def test_tree_iid_children_is_exact(replace):
    p, q = tables(SamplingParams(0.8), SamplingParams(1.1))
    counts = run_tree_iid(p, q, TreeSpec.from_choices(IID_TREE), replace=replace, seed=11 + replace)
    assert_exact(counts, p)


def test_sample_is_exact():
    rng = np.random.default_rng(5)
    probs = np.array([0.3, 0.0, 0.1, 0.25, 0.0, 0.05, 0.2, 0.1])
    counts = np.bincount([sample(probs, rng) for _ in range(50_000)], minlength=V)
    assert chi_square_p_value(counts, probs) > MIN_P_VALUE


# --- negative controls: the test must catch a wrong verifier ---------------------------------


def _accept_everything(drafts, target_probs, rng, draft_probs=None, greedy=False):
    k = len(drafts)
    return ChainResult(list(drafts) + [sample(target_probs[k], rng)], k)


def _residual_from_p(drafts, target_probs, rng, draft_probs=None, greedy=False):
    """A plausible bug: on rejection sample from p instead of norm(max(p - q, 0))."""
    for i, x in enumerate(drafts):
        if rng.random() * draft_probs[i][x] >= target_probs[i][x]:
            return ChainResult(list(drafts[:i]) + [sample(target_probs[i], rng)], i)
    return ChainResult(list(drafts) + [sample(target_probs[len(drafts)], rng)], len(drafts))


@pytest.mark.parametrize("wrong", [_accept_everything, _residual_from_p], ids=["accept-all", "residual-from-p"])
def test_chi_square_detects_a_wrong_verifier(wrong):
    p, q = tables(T1, T1)
    counts = run_chain(p, q, k=2, soft=True, seed=99, n=N // 5, verify=wrong)  # even 20k samples
    pv = chi_square_p_value(counts, exact_joint(p))
    assert pv < 1e-6


# --------------------------------------------------------------------------------------------
# Greedy: token-identical to argmax decoding
# --------------------------------------------------------------------------------------------


def greedy_decode(p_logits: np.ndarray, root: int, length: int) -> list[int]:
    out, last = [], root
    for _ in range(length):
        last = int(np.argmax(p_logits[last]))
        out.append(last)
    return out


def test_greedy_chain_matches_argmax_decoding():
    target, draft = model_logits(3, agreement=0.5)
    p = process_logits(target, SamplingParams())
    rng = np.random.default_rng(0)
    for trial in range(30):
        want = greedy_decode(target, ROOT, 40)
        out, last = [], ROOT
        while len(out) < 40:
            k = int(rng.integers(1, 5))
            xs = [int(t) for t in rng.integers(0, V, size=k)] if trial % 2 else greedy_decode(draft, last, k)
            res = verify_chain(xs, p[[last] + xs], None, greedy=True)
            assert res.tokens[: res.num_accepted] == xs[: res.num_accepted]
            out += res.tokens
            last = out[-1]
        assert out[:40] == want


def test_greedy_chain_accepts_the_argmax_run():
    p = np.eye(V)[[1, 2, 3, 4]]  # argmax continuation 1, 2, 3 then bonus 4
    assert verify_chain([1, 2, 3], p, None, greedy=True) == ChainResult([1, 2, 3, 4], 3)
    assert verify_chain([1, 5, 3], p, None, greedy=True) == ChainResult([1, 2], 1)
    assert verify_chain([], p[:1], None, greedy=True) == ChainResult([1], 0)


def test_greedy_tree_matches_argmax_decoding():
    target, draft = model_logits(4, agreement=0.5)
    p = process_logits(target, SamplingParams())
    q = process_logits(draft, SamplingParams(1.0))
    tree = TreeSpec.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    want = greedy_decode(target, ROOT, 40)
    out, last = [], ROOT
    while len(out) < 40:
        toks = draft_tree_tokens(tree, q, last)
        res = verify_tree(tree, toks, p[toks], None, greedy=True)
        assert [toks[i] for i in res.path] == res.tokens[:-1]
        out += res.tokens
        last = out[-1]
    assert out[:40] == want


# --------------------------------------------------------------------------------------------
# Unit behaviour of the verifiers
# --------------------------------------------------------------------------------------------


class FixedRng:
    """Stands in for np.random.Generator: returns preset uniforms in order."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_verify_chain_accept_and_reject_rules():
    p = np.array([[0.5, 0.5, 0, 0], [0.1, 0.2, 0.3, 0.4], [0.25] * 4])
    q = np.array([[0.25, 0.75, 0, 0], [0.5, 0.5, 0, 0]])
    # x0 = 1: p/q = 2/3 -> accepted with u = 0.6; x1 = 0: p/q = 0.2 -> rejected with u = 0.3.
    res = verify_chain([1, 0], p, FixedRng(0.6, 0.3, 0.0), q)
    # residual max(p1 - q1, 0) = [0, 0, .3, .4]; u = 0 -> token 2
    assert res == ChainResult([1, 2], 1)
    res = verify_chain([1, 0], p, FixedRng(0.7, 0.3, 0.0), q)  # u = 0.7 > 2/3 -> reject x0
    assert res == ChainResult([0], 0)  # residual [.25, 0, 0, 0]
    res = verify_chain([1, 0], p, FixedRng(0.0, 0.0, 0.99), q)  # all accepted, bonus from row 2
    assert res == ChainResult([1, 0, 3], 2)


def test_verify_chain_one_hot_rejection_removes_the_draft():
    p = np.array([[0.6, 0.4, 0.0], [1 / 3] * 3])
    res = verify_chain([0], p, FixedRng(0.7, 0.0))  # u = 0.7 >= p(0) -> reject, residual [0, .4, 0]
    assert res == ChainResult([1], 0)


def test_verify_chain_p_equal_q_always_accepts():
    rng = np.random.default_rng(0)
    p = process_logits(rng.normal(size=(3, V)), T1)
    for _ in range(200):
        assert verify_chain([1, 2], p, rng, p[:2]).num_accepted == 2


def test_verify_chain_rejects_bad_input():
    p = np.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_chain([1], p, np.random.default_rng(0), np.array([[1.0, 0, 0, 0]]))
    with pytest.raises(ValueError, match="target_probs"):
        verify_chain([1, 2], p, np.random.default_rng(0))
    with pytest.raises(ValueError, match="rng"):
        verify_chain([1], p, None)


def test_verify_tree_deterministic_tries_children_in_order():
    tree = TreeSpec.from_choices([[0], [1], [2]])
    p = np.zeros((4, V))
    p[0, :4] = [0.4, 0.3, 0.2, 0.1]
    p[1:] = 1.0 / V
    toks = [ROOT, 0, 1, 2]
    # child 0 (p=.4): u=.5 -> reject; residual [0,.3,.2,.1] (mass .6); child 1: u*.6=.54 >= .3 reject;
    # residual [0,0,.2,.1]; child 2: u*.3 = .03 < .2 -> accept node 3, then bonus from p[3].
    res = verify_tree(tree, toks, p, FixedRng(0.5, 0.9, 0.1, 0.0))
    assert res == TreeResult([3], [2, 0])
    # all rejected -> sample the residual [0, 0, 0, .1]
    res = verify_tree(tree, toks, p, FixedRng(0.5, 0.9, 0.9, 0.5))
    assert res == TreeResult([], [3])


def test_verify_tree_iid_without_replacement_updates_q():
    tree = TreeSpec.from_choices([[0], [1]])
    p = np.full((3, 4), 0.25)
    p[0] = [0.1, 0.2, 0.3, 0.4]
    q = np.array([0.5, 0.3, 0.2, 0.0])
    cp = np.stack([q, q, q])
    # child token 0: p/q = .2, u = .5 -> reject; p <- norm(max(p - q, 0)) = [0, 0, .1, .4]/.5
    # without replacement q <- [0, .6, .4, 0]: child token 1 has p = 0 -> rejected for sure;
    # residual max([0,0,.2,.8] - [0,.6,.4,0], 0) = [0,0,0,.8] -> token 3.
    res = verify_tree(tree, [ROOT, 0, 1], p, FixedRng(0.5, 0.0, 0.3), child_probs=cp, mode="iid_without_replacement")
    assert res == TreeResult([], [3])
    with pytest.raises(ValueError, match="child_probs"):
        verify_tree(tree, [ROOT, 0, 1], p, FixedRng(0.5), mode="iid")
    with pytest.raises(ValueError, match="mode"):
        verify_tree(tree, [ROOT, 0, 1], p, FixedRng(0.5), mode="typical")


def test_verify_tree_leaf_gives_bonus_token():
    tree = TreeSpec.chain(1)
    p = np.zeros((2, V))
    p[0, 5] = 1.0
    p[1, 6] = 1.0
    assert verify_tree(tree, [ROOT, 5], p, np.random.default_rng(0)) == TreeResult([1], [5, 6])


# --------------------------------------------------------------------------------------------
# sample
# --------------------------------------------------------------------------------------------


def test_sample_never_returns_a_zero_probability_token():
    probs = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    assert sample(probs, FixedRng(0.0)) == 1
    assert sample(probs, FixedRng(0.5)) == 3
    assert sample(probs, FixedRng(np.nextafter(1.0, 0.0))) == 3
    # a cumulative sum that rounds below the scaled uniform still lands on a real token
    tiny = np.array([0.1] * 10 + [0.0])
    assert sample(tiny, FixedRng(np.nextafter(1.0, 0.0))) == 9


def test_sample_accepts_unnormalised_weights():
    assert sample(np.array([0.0, 2.0, 6.0]), FixedRng(0.2)) == 1
    assert sample(np.array([0.0, 2.0, 6.0]), FixedRng(0.3)) == 2
    with pytest.raises(ValueError):
        sample(np.zeros(3), FixedRng(0.2))


# --------------------------------------------------------------------------------------------
# process_logits
# --------------------------------------------------------------------------------------------


def reference_process(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Straightforward per-row implementation (full stable sorts) to compare against."""
    x = np.atleast_2d(np.asarray(logits, dtype=np.float64))
    out = np.zeros_like(x)
    for r, row in enumerate(x):
        if params.greedy:
            out[r, np.argmax(row)] = 1.0
            continue
        z = row / params.temperature
        if 0 < params.top_k < len(z):
            order = np.argsort(-row, kind="stable")
            z[order[params.top_k :]] = -np.inf
        e = np.exp(z - z.max())
        prob = e / e.sum()
        if params.top_p < 1:
            order = np.argsort(-prob, kind="stable")
            count = int((np.cumsum(prob[order]) < params.top_p).sum()) + 1
            prob[order[count:]] = 0.0
            prob /= prob.sum()
        out[r] = prob
    return out.reshape(np.shape(logits))


PROCESS_PARAMS = [
    SamplingParams(),
    SamplingParams(1.0),
    SamplingParams(0.5),
    SamplingParams(1.0, top_k=1),
    SamplingParams(0.7, top_k=3),
    SamplingParams(1.3, top_p=0.5),
    SamplingParams(0.8, top_k=5, top_p=0.8),
    SamplingParams(1.0, top_p=1e-9),
    SamplingParams(1.0, top_k=100),
]


@pytest.mark.parametrize("params", PROCESS_PARAMS, ids=str)
def test_process_logits_matches_reference(params):
    rng = np.random.default_rng(0)
    for ties in (False, True):
        # integer logits from a small range force plenty of ties
        x = rng.integers(-3, 3, size=(20, 12)).astype(np.float32) if ties else rng.normal(size=(20, 12)) * 2
        got = process_logits(x, params)
        assert got.dtype == np.float64 and got.shape == x.shape
        np.testing.assert_allclose(got, reference_process(x, params), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-12)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999])
@pytest.mark.parametrize("flat", [False, True])
def test_top_p_large_vocab_matches_reference(top_p, flat):
    rng = np.random.default_rng(1)
    scale = 0.05 if flat else 4.0  # flat rows need more than the first candidate batch
    x = (rng.normal(size=(3, 49152)) * scale).astype(np.float32)
    x[0, 100:3000] = x[0, 50]  # a long run of ties around the head
    params = SamplingParams(1.0, top_p=top_p)
    np.testing.assert_allclose(process_logits(x, params), reference_process(x, params), rtol=1e-10, atol=1e-15)


def test_top_k_ties_go_to_lowest_ids_on_large_vocab():
    x = np.zeros((2, 49152), dtype=np.float32)
    x[0, 40000] = 5.0
    got = process_logits(x, SamplingParams(1.0, top_k=3))
    assert np.flatnonzero(got[0]).tolist() == [0, 1, 40000]
    assert np.flatnonzero(got[1]).tolist() == [0, 1, 2]


def test_process_logits_one_dimensional_and_greedy_ties():
    x = np.array([1.0, 3.0, 3.0, -1.0])
    assert process_logits(x, SamplingParams()).tolist() == [0.0, 1.0, 0.0, 0.0]
    p = process_logits(x, SamplingParams(2.0))
    e = np.exp(x / 2.0)
    np.testing.assert_allclose(p, e / e.sum())
    assert process_logits(x, SamplingParams(1.0, top_p=0.01)).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_process_logits_keeps_masked_tokens_at_zero():
    x = np.array([[0.0, -np.inf, 1.0, -np.inf]])
    p = process_logits(x, SamplingParams(1.0, top_k=3))
    assert p[0, 1] == 0 and p[0, 3] == 0 and p.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="finite"):
        process_logits(np.full((1, 4), -np.inf), SamplingParams(1.0))


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(temperature=-1), "--temperature must be >= 0, got -1"),
        (SamplingParams(temperature=float("nan")), "--temperature must be >= 0, got nan"),
        (SamplingParams(temperature=1.0, top_p=0), "--top-p must be in (0, 1], got 0"),
        (SamplingParams(temperature=1.0, top_p=1.5), "--top-p must be in (0, 1], got 1.5"),
        (SamplingParams(temperature=1.0, top_k=-2), "--top-k must be >= 0, got -2"),
    ],
)
def test_sampling_params_validate(params, message):
    """The API names its fields (top_p), the CLI its flags (--top-p)."""
    with pytest.raises(InputError) as err:
        params.validate()
    flags = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k"}
    assert err.value.naming(flags) == message
    assert str(err.value) == message.replace("--top-", "top_").removeprefix("--")
    with pytest.raises(InputError):
        process_logits(np.zeros(4), params)


def test_sampling_params_greedy_flag():
    assert SamplingParams().greedy
    assert not SamplingParams(0.7).greedy
    assert SamplingParams(0.7, top_k=5, top_p=0.9, seed=3).validate().top_k == 5


def test_greedy_path_follows_each_rows_best_token():
    """Greedy verification from per-row argmax ids (the GPU graph's next_tokens, or the logits' argmax)."""
    from speccompile.runtime.verification import greedy_path
    from speccompile.runtime.tree import TreeSpec

    best = [5, 7, 9, 4].__getitem__
    assert greedy_path(None, [1, 5, 6, 8], best) == ([1], [5, 7])  # 5 accepted, 6 rejected for 7
    assert greedy_path(None, [1, 5, 7, 9], best) == ([1, 2, 3], [5, 7, 9, 4])  # all accepted + the bonus row's best
    tree = TreeSpec.from_choices([[0], [1], [1, 0]])  # node 1 = rank 0, node 2 = rank 1, node 3 under node 2
    # node tokens: 1 -> 3, 2 -> 5, 3 -> 6 (under node 2)
    assert greedy_path(tree, [1, 3, 5, 6], [5, 0, 6, 2].__getitem__) == ([2, 3], [5, 6, 2])  # the rank-1 branch
    assert greedy_path(tree, [1, 3, 5, 6], [5, 0, 8, 2].__getitem__) == ([2], [5, 8])  # node 3 rejected for row 2's best
