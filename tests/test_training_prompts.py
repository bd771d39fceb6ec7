"""The SmolLM2 head's training prompts (benchmarks/train_smollm2_head.py) stay out of the chat benchmark."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import load_benchmark

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _script():
    return load_benchmark("train_smollm2_head")


def test_prompt_sets_are_disjoint_from_each_other_and_the_chat_workload():
    script = _script()
    sets = [script.training_prompts(10**6), script.more_training_prompts(10**6), script.third_training_prompts(10**6)]
    workload = {json.loads(line)["prompt"] for line in (BENCHMARKS / "workloads" / "chat.jsonl").read_text().splitlines() if line.strip()}
    assert [len(s) for s in sets] == [len(set(s)) for s in sets] and all(len(s) >= 400 for s in sets)
    for i, a in enumerate(sets):
        assert not set(a) & workload
        for b in sets[i + 1:]:
            assert not set(a) & set(b)
    assert script.more_training_prompts(540)[:10] == sets[1][:10]  # the first N are stable (cached answer files)
