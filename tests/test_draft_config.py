"""The draft configuration: one grammar for --tree and k, shared by export and runtime."""

from __future__ import annotations

import pytest

from speccompile.errors import ArtifactError, InputError
from speccompile.draft_config import DraftConfig, DynamicTree, draft_config_for_run
from speccompile.runtime.tree import load_tree


def test_defaults_and_the_meaning_of_k():
    assert DraftConfig.parse("ngram").num_draft_tokens == 12 and DraftConfig.parse("ngram").shape == "chain"
    assert DraftConfig.parse("draft-model").num_draft_tokens == 4
    eagle = DraftConfig.parse("eagle3")  # eagle-default: k is the tree's depth
    assert eagle.shape == "static" and eagle.tree_name == "eagle-default" and eagle.num_draft_tokens == load_tree("eagle-default").max_depth
    assert DraftConfig.parse("mtp").choices == ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))  # mtp: a chain of 4
    six = DraftConfig.parse("eagle", "chain", 6)
    assert six.num_draft_tokens == 6 and six.choices == tuple((0,) * d for d in range(1, 7)) and six.tree_name == "chain-6"
    assert DraftConfig.parse("eagle", "tree-2x3", 2).num_draft_tokens == 2  # k cuts a static tree's depth
    dyn = DraftConfig.parse("eagle", "dynamic-6-4-12-p0.15")
    assert dyn.shape == "dynamic" and dyn.dynamic == DynamicTree(6, 4, 12, 0.15) and dyn.num_draft_tokens == 6
    assert DraftConfig.parse("eagle", "dynamic").dynamic == DynamicTree()


def test_manifest_round_trip_and_old_manifests():
    for config in (DraftConfig.parse("eagle", "tree-2x2"), DraftConfig.parse("eagle3", "dynamic-3-2-6-p0.25", 2),
                   DraftConfig.parse("ngram", None, 7), DraftConfig.parse("mtp", "chain", 5)):
        section = {"kind": config.kind, **config.to_manifest()}
        assert DraftConfig.from_manifest(section) == config
    assert DraftConfig.from_manifest({"kind": "ngram"}).num_draft_tokens == 12  # artifacts exported before k was recorded
    old = {"kind": "eagle", "tree": [[0], [1], [0, 0]], "tree_name": "x"}
    assert DraftConfig.from_manifest(old).num_draft_tokens == 2
    with pytest.raises(ArtifactError, match="no tree"):
        DraftConfig.from_manifest({"kind": "eagle"})


def test_run_overrides_the_exported_config():
    exported = {"kind": "eagle", **DraftConfig.parse("eagle", "tree-2x3").to_manifest()}
    assert draft_config_for_run("eagle", exported) == DraftConfig.parse("eagle", "tree-2x3")
    assert draft_config_for_run("eagle", exported, num_draft_tokens=2).num_draft_tokens == 2
    # a tree on the command line is parsed with the k given with it (not the default 4)
    assert draft_config_for_run("eagle", exported, "chain", 6).choices == tuple((0,) * d for d in range(1, 7))
    assert draft_config_for_run("ngram", exported).num_draft_tokens == 12  # another drafter than the exported one: its defaults


@pytest.mark.parametrize("kind,tree,k,message", [
    ("ngram", "chain", None, "drafts chains"),
    ("medusa", "dynamic", None, "Medusa"),
    ("eagle", "dynamic-3-2-6-p1.5", None, "minimum draft probability"),
    ("eagle", "dynamic-0-2-6", None, ">= 1"),
    ("eagle", "bogus", None, "unknown tree preset"),
    ("eagle", None, -1, "^num_draft_tokens must be >= 0"),
])
def test_bad_configs_are_one_line_input_errors(kind, tree, k, message):
    with pytest.raises(InputError, match=message):
        DraftConfig.parse(kind, tree, k)


def test_exported_ngram_k_is_what_run_drafts(tiny_model_dir, tmp_path):
    # `export --drafter ngram --num-draft-tokens 7` used to be dropped (run then drafted up to 12)
    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.runtime.session import Runner

    manifest = export_artifact(str(tiny_model_dir), tmp_path / "art", ExportOptions(drafter="ngram", num_draft_tokens=7))
    assert manifest.drafter["num_draft_tokens"] == 7
    runner = Runner(tmp_path / "art", threads=1, adaptive=False)
    assert runner.drafter_name == "ngram" and runner.num_draft_tokens == 7
    result = runner.generate("abc abc abc abc abc abc abc abc abc abc", chat=False, max_tokens=40)
    assert result.stats.draft_steps > 0 and len(result.stats.drafted) <= 7
