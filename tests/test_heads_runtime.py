"""Export + runtime for every head kind: greedy speculative output == plain, for chain / static / dynamic trees."""

from __future__ import annotations

import pytest

from speccompile.draft_config import DraftConfig
from test_heads_helpers import shared_target, trained_head, word_prompt_ids, write_checkpoint

PROMPTS = [[1, 40, 41, 42, 43, 10, 11, 12, 13, 40, 41, 42]]  # + two word prompts (set in target_dir)
TREES = {  # --tree values (None: the exported default, eagle-default)
    "chain": "chain-4",
    "static": None,
    "dynamic": "dynamic-4-3-12",
    "dynamic-confident": "dynamic-4-3-12-p0.05",
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    folder = shared_target(tmp_path_factory)
    if len(PROMPTS) == 1:
        PROMPTS.extend([word_prompt_ids(1), word_prompt_ids(2)])
    return folder


def export_with(kind, target_dir, out, ckpt=None, tree=None):
    from speccompile.export.pipeline import ExportOptions, export_artifact

    ckpt = ckpt or write_checkpoint(out.parent / f"{out.name}_ckpt", kind)
    return export_artifact(str(target_dir), out, ExportOptions(drafter=f"{kind}:{ckpt}", tree=tree, max_context=256))


def spec_vs_plain(artifact, kind, trees, max_tokens=32, k=4):
    from speccompile.runtime.session import Runner

    runner = Runner(artifact, drafter=kind, num_draft_tokens=k, adaptive=False, threads=1)
    drafter = runner.drafter()
    stats = {}
    exported = drafter.inner.draft_config
    for name, tree in trees.items():
        drafter.inner.set_tree(DraftConfig.parse(kind, tree, k) if isinstance(tree, str) else (tree or exported))
        drafted = accepted = 0
        for prompt in PROMPTS:
            plain = runner.generate_ids(prompt, max_tokens, drafter="none")
            spec = runner.generate_ids(prompt, max_tokens)
            assert spec.tokens == plain.tokens, (kind, name, prompt)
            drafted += spec.stats.draft_steps
            accepted += sum(spec.stats.accepted)
        stats[name] = (drafted, accepted)
    print(kind, stats, drafter.rates.observed)
    assert drafter.rates.observed, "the n-gram lookup branch was never verified"  # PROMPTS[0] repeats 40 41 42
    return stats


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
def test_autoregressive_heads_greedy_equal_plain(kind, target_dir, tmp_path, tmp_path_factory):
    # eagle / eagle3: heads trained for a few steps (so drafts get accepted and the head cache must
    # follow multi-token acceptances); mtp: a random checkpoint in the DeepSeek layout
    ckpt = trained_head(tmp_path_factory, kind) if kind != "mtp" else None
    m = export_with(kind, target_dir, tmp_path / "art", ckpt=ckpt)
    d = m.drafter
    assert d["kind"] == kind and d["graph"] == kind and isinstance(d["tree"], list) and d["num_draft_tokens"] >= 1
    assert m.graphs["target"].hidden_states == ("eagle3" if kind == "eagle3" else "final")
    assert f"{kind}.onnx" in m.files
    trees = TREES if kind != "mtp" else {"chain": None, "static": DraftConfig("mtp", 4, ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))),
                                          "dynamic": TREES["dynamic"]}
    stats = spec_vs_plain(tmp_path / "art", kind, trees)
    assert all(s[0] > 0 for s in stats.values()), stats
    if kind != "mtp":
        assert all(s[1] > 0 for s in stats.values()), stats  # trained heads: drafts were accepted


def test_medusa_tree_greedy_equal_plain(target_dir, tmp_path, tmp_path_factory):
    m = export_with("medusa", target_dir, tmp_path / "art", ckpt=trained_head(tmp_path_factory, "medusa"), tree="tree-3x3")
    assert m.drafter["tree"] == [[0], [1], [2], [0, 0], [1, 0], [2, 0], [0, 0, 0], [1, 0, 0], [2, 0, 0]]
    stats = spec_vs_plain(tmp_path / "art", "medusa", {"static": None, "chain": "chain-3"})
    assert all(s[0] > 0 and s[1] > 0 for s in stats.values()), stats


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_planned_static_tree_greedy_equal_plain(kind, target_dir, tmp_path, tmp_path_factory):
    # adaptive (the default): the planner picks the subtree of the exported tree per step from measured
    # per-node acceptance; outputs stay identical and the planner learns rates for the drafted nodes
    from speccompile.runtime.sampling import SamplingParams
    from speccompile.runtime.session import Runner

    export_with(kind, target_dir, tmp_path / "art", ckpt=trained_head(tmp_path_factory, kind),
                tree="tree-3x3" if kind == "medusa" else None)
    runner = Runner(tmp_path / "art", drafter=kind, adaptive=True, threads=1)
    drafter = runner.drafter().inner  # the head under the lookup branch
    drafted = 0
    for prompt in PROMPTS:
        plain = runner.generate_ids(prompt, 32, drafter="none")
        spec = runner.generate_ids(prompt, 32)
        assert spec.tokens == plain.tokens
        drafted += spec.stats.draft_steps
    assert drafter.planner is not None and drafted > 0
    rates = drafter.planner.rates.observed
    assert rates and all(0.0 <= r <= 1.0 for r in rates.values())
    # a head that "never pays": only the probe steps draft, the others skip the head entirely and the
    # committed rows are fed in one call on the next drafting step (the head cache must stay in step);
    # without the lookup branch, which would still draft on its own
    head_only = Runner(tmp_path / "art", drafter=kind, adaptive=True, threads=1, lookup_branch=False)
    planner = head_only.drafter().planner
    planner.rates.alpha = 0.0  # keep the rates at zero through the generation
    planner.rates.observed.update({tuple(c): 0.0 for c in planner.full(8).choices()})
    plain = head_only.generate_ids(PROMPTS[0], 40, drafter="none")
    sparse = head_only.generate_ids(PROMPTS[0], 40)
    assert sparse.tokens == plain.tokens
    assert 0 < sparse.stats.draft_steps < sparse.stats.target_passes // 4, sparse.stats
    # seeded sampling: the planner starts afresh each generation, so a seed reproduces its output
    params = SamplingParams(temperature=0.8, seed=11)
    assert runner.generate_ids(PROMPTS[1], 24, sampling=params).tokens == runner.generate_ids(PROMPTS[1], 24, sampling=params).tokens


def test_head_without_lookup_branch(target_dir, tmp_path, tmp_path_factory):
    # --no-lookup-branch: the head's own tree only (and the same output)
    from speccompile.runtime.drafters.eagle import HeadDrafter
    from speccompile.runtime.session import Runner

    export_with("eagle3", target_dir, tmp_path / "art", ckpt=trained_head(tmp_path_factory, "eagle3"))
    runner = Runner(tmp_path / "art", drafter="eagle3", threads=1, lookup_branch=False)
    assert isinstance(runner.drafter(), HeadDrafter)
    for prompt in PROMPTS[:2]:
        assert runner.generate_ids(prompt, 32).tokens == runner.generate_ids(prompt, 32, drafter="none").tokens


def test_dynamic_tree_export_and_sampling_runs(target_dir, tmp_path):
    from speccompile.errors import InputError
    from speccompile.runtime.sampling import SamplingParams
    from speccompile.runtime.session import Runner

    m = export_with("eagle", target_dir, tmp_path / "confident", tree="dynamic-3-2-6-p0.25")
    assert m.drafter["dynamic"] == {"depth": 3, "top_k": 2, "total_tokens": 6, "min_prob": 0.25}
    with pytest.raises(InputError, match="minimum draft probability"):
        export_with("eagle", target_dir, tmp_path / "bad-p", tree="dynamic-3-2-6-p1.5")
    m = export_with("eagle", target_dir, tmp_path / "art", tree="dynamic-3-2-6")
    assert m.drafter["tree"] == "dynamic" and m.drafter["dynamic"] == {"depth": 3, "top_k": 2, "total_tokens": 6}
    runner = Runner(tmp_path / "art", threads=1)
    assert runner.drafter_name == "eagle" and runner.num_draft_tokens == 3
    out = runner.generate_ids(PROMPTS[0], 20, sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=3))
    assert len(out.tokens) >= 1
    with pytest.raises(InputError, match="Medusa"):
        export_with("medusa", target_dir, tmp_path / "bad", tree="dynamic")


def test_run_tree_chain_with_k_drafts_that_deep(target_dir, tmp_path):
    # on a head artifact, `run --tree chain -k 6 --no-lookup-branch` used to draft a 4-deep chain
    from speccompile.runtime.session import Runner

    export_with("mtp", target_dir, tmp_path / "art")
    runner = Runner(tmp_path / "art", drafter="mtp", tree="chain", num_draft_tokens=6, lookup_branch=False, adaptive=False, threads=1)
    assert runner.num_draft_tokens == 6 and len(runner.draft_config.choices) == 6
    result = runner.generate_ids(PROMPTS[0], 24)
    assert len(result.stats.drafted) == 6, result.stats.drafted  # every step drafted all six positions
    assert result.tokens == runner.generate_ids(PROMPTS[0], 24, drafter="none").tokens
