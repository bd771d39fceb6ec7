"""Runtime: greedy speculative == plain, stops inside accepted runs, draft KV consistency, bad input."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import numpy as np
import pytest

from speccompile.errors import ArtifactError, InputError
from speccompile.runtime.adaptive import Sizing
from speccompile.runtime.drafters.base import GenerationStart
from speccompile.runtime.drafters.ngram import NgramDrafter
from speccompile.runtime.kvcache import KVCache
from speccompile.runtime.sampling import SamplingParams
from speccompile.runtime.session import Runner

from conftest import make_tiny_hf_model, run_cli

PROMPTS = ["abc abc abc abc abc", "the cat sat on the mat. the cat sat on the", "x = 1\ny = 2\nx = 1\ny =", "hello"]


def test_ngram_lookup_finds_latest_longest_match():
    d = NgramDrafter(min_match=1, max_match=3)
    draft = d.lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2)
    assert draft.tokens == [7, 1]
    assert draft.key == 3
    assert d.lookup([5, 6, 7], 3).tokens == []
    assert d.lookup([4, 8, 4], 4).tokens == [8, 4, 8, 4]  # the match 2 back: a repetition of period 2


def test_a_generation_s_own_match_lengths_apply_to_it_alone():
    """DraftTuning's min_match / max_match (vLLM's prompt_lookup_min / _max in a request's speculative_config)."""
    from speccompile.runtime.options import DraftTuning

    d = NgramDrafter(min_match=1, max_match=3)
    history = [1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3]
    d.start(GenerationStart(tuning=DraftTuning(max_match=1)))
    assert d.lookup(history, 2).key == 1
    d.start(GenerationStart(tuning=DraftTuning(min_match=4)))  # longer than any earlier match: nothing drafted
    assert (d.min_match, d.max_match, d.lookup(history, 2).tokens) == (4, 4, [])
    d.start(GenerationStart())
    assert d.lookup(history, 2).key == 3


def test_ngram_lookup_continues_a_repetition_past_the_history():
    """A match that ends just before the suffix copies on as the repetition it implies (an overlapping copy):
    a run of period p drafts k tokens, not p."""
    d = NgramDrafter(min_match=1, max_match=4)
    assert d.lookup([7, 138, 5, 138, 5, 138, 5], 7).tokens == [138, 5, 138, 5, 138, 5, 138]
    assert d.lookup([3, 1, 2, 3, 9, 1, 2, 3], 6).tokens == [9, 1, 2, 3, 9, 1]  # period 4
    assert d.lookup([6, 6], 3).tokens == [6, 6, 6]
    assert d.lookup([1, 2, 3, 9, 1, 2, 3], 3).tokens == [9, 1, 2]  # within the history: unchanged


def test_ngram_lookup_resumes_the_copy_after_an_edit():
    source = [1, 5, 2, 5, 3, 5, 4]
    d = NgramDrafter(min_match=1, max_match=1)
    assert d.lookup(source + [1], 3).tokens == [5, 2, 5]  # copying from index 1
    # three tokens emitted since (an edit: 9, 9 replaced 5, 2), then 5: of the three earlier 5s the
    # one the copy has reached (source index 4) wins over the latest one
    assert d.lookup(source + [1, 9, 9, 5], 3).tokens == [3, 5, 4]
    fresh = NgramDrafter(min_match=1, max_match=1)
    assert fresh.lookup(source + [1, 9, 9, 5], 3).tokens == [4, 1, 9]  # no copy in progress: the latest
    d.start(GenerationStart())
    assert d.lookup(source + [1, 9, 9, 5], 3).tokens == [4, 1, 9]


def _brute_force_proposal(history: list[int], k: int, pointer: int | None, d: NgramDrafter) -> tuple[list[int], int]:
    """The lookup rule by brute force: the longest suffix seen earlier with something after it; among its
    occurrences the closest to `pointer` within [pointer - back, pointer + window], else the latest."""
    for n in range(min(d.max_match, len(history) - 1), d.min_match - 1, -1):
        starts = [s for s in range(n, len(history)) if history[s - n: s] == history[-n:]]
        if not starts:
            continue
        start = starts[-1]
        near = [s for s in starts if pointer is not None and pointer - d.resume_back <= s <= pointer + d.resume_window]
        if near:
            start = min(near, key=lambda s: abs(s - pointer))
        period = len(history) - start  # past the history's end the copy repeats itself with this period
        return [history[start + i] if start + i < len(history) else history[start + i - period * ((start + i - len(history)) // period + 1)]
                for i in range(k)][: k], start
    return [], -1


def test_ngram_lookup_equals_the_brute_force_rule_as_the_history_grows():
    """The drafter's n-gram index (kept up to date as the history grows, rebuilt for another history) proposes
    what a scan of the whole history would, resumed copies included."""
    rng = np.random.default_rng(0)
    d = NgramDrafter(min_match=1, max_match=4)
    for _ in range(3):  # a new history each time: the index starts over
        history = [int(t) for t in rng.integers(0, 6, 5)]
        pointer = None
        for _ in range(150):
            k = int(rng.integers(1, 6))
            expected, start = _brute_force_proposal(history, k, pointer, d)
            assert d.lookup(history, k).tokens == expected
            copied_from, proposed_at = (start, len(history)) if expected else (None, 0)
            accepted = expected[: int(rng.integers(0, len(expected) + 1))] if rng.random() < 0.7 else []
            history = history + accepted + [int(t) for t in rng.integers(0, 6, int(rng.integers(1, 3)))]
            pointer = None if copied_from is None else copied_from + len(history) - proposed_at


def test_kvcache_lazy_drop_and_compact():
    cache = KVCache([np.zeros((1, 1, 0, 2), np.float32)], max_dead=2)
    rows = np.arange(5, dtype=np.float32).reshape(1, 1, 5, 1).repeat(2, axis=3)
    cache.append([rows], keep=[0, 1, 3], num_new=5)
    assert cache.length == 3 and cache.dead == 2
    mask = cache.attention_mask(np.ones((1, 1), bool))
    assert mask.tolist() == [[[True, True, False, True, False, True]]]
    cache.compact()
    assert cache.tensors[0][0, 0, :, 0].tolist() == [0, 1, 3]
    assert cache.physical_len == 3 and cache.compactions == 1
    cache.truncate(2)
    assert cache.length == 2


def test_ngram_replay_gains_on_copies_and_respects_cuts_and_costs():
    """benchmarks/ngram_replay.py sizes drafts as a runner does: an output that copies its prompt is replayed at
    several tokens a pass and above plain speed; cuts every 64 slots (head_dim 256) hold passes to their segments,
    so fewer tokens a pass; where a verified row costs a whole pass, it only probes and never beats plain."""
    from conftest import load_benchmark

    replay = load_benchmark("ngram_replay")
    text = [int(t) for t in np.random.default_rng(0).integers(10, 500, size=120)]
    rows = [{"prompt": [1, *text], "output": text[:100]} for _ in range(3)]
    cheap = replay.cost_table({1: 1.0, 2: 1.05, 8: 1.4, 25: 2.2})
    tokens, speed = replay.replay(rows, 12, 4, cheap)
    cut_tokens, cut_speed = replay.replay(rows, 12, 4, cheap, cut_block=128)
    assert tokens > 6 and speed > 2.0
    assert 1.0 < cut_tokens < tokens and cut_speed < speed
    dear_tokens, dear_speed = replay.replay(rows, 12, 4, replay.cost_table({1: 1.0, 2: 2.0, 25: 25.0}))
    assert dear_speed <= 1.0 + 1e-9 and dear_tokens < 1.5


@pytest.mark.parametrize("adaptive,fused", [(True, True), (False, True), (True, False)])
def test_greedy_ngram_equals_plain(tiny_artifact, adaptive, fused):
    runner = Runner(tiny_artifact, drafter="ngram", num_draft_tokens=5, adaptive=adaptive, threads=1, contract_graph=not fused)
    assert runner.artifact.target.spec.file == ("target.ort.onnx" if fused else "target.onnx")
    accepted = 0
    for prompt in PROMPTS:
        plain = runner.generate(prompt, chat=False, max_tokens=48, drafter="none")
        spec = runner.generate(prompt, chat=False, max_tokens=48)
        assert spec.tokens == plain.tokens, prompt
        assert plain.stats.mean_accepted_length == 1.0
        accepted += sum(spec.stats.accepted)
    assert accepted > 0  # the drafts were really exercised


@pytest.mark.parametrize("fused", [True, False])
def test_greedy_draft_model_equals_plain(tiny_artifact_with_draft, fused):
    runner = Runner(tiny_artifact_with_draft, drafter="draft-model", num_draft_tokens=3, adaptive=False, threads=1, contract_graph=not fused)
    assert runner.drafter_name == "draft-model"
    assert runner.artifact.session("draft").spec.file == ("draft.ort.onnx" if fused else "draft.onnx")
    if fused:  # the draft model's CPU graph runs packed (export/cpu_draft_weights.py: int8 MatMulNBits by default)
        import onnx

        graph = onnx.load(str(tiny_artifact_with_draft / "draft.ort.onnx"), load_external_data=False).graph
        assert runner.artifact.session("draft").spec.extra["weights"] == "int8"
        assert "MatMulNBits" in {n.op_type for n in graph.node} and "MatMul" not in {n.op_type for n in graph.node}
    for prompt in PROMPTS[:3]:
        plain = runner.generate(prompt, chat=True, max_tokens=40, drafter="none")
        spec = runner.generate(prompt, chat=True, max_tokens=40)
        assert spec.tokens == plain.tokens
        assert spec.stats.draft_steps > 0


def test_target_as_its_own_draft_accepts_everything(tmp_path, tiny_model_dir):
    from speccompile.export.pipeline import ExportOptions, export_artifact

    out = tmp_path / "self"
    export_artifact(str(tiny_model_dir), out, ExportOptions(max_context=256, drafter=f"draft-model:{tiny_model_dir}",
                                                            draft_cpu_weights="fp32"))  # the draft's CPU graph unquantized: the target's numbers
    runner = Runner(out, drafter="draft-model", num_draft_tokens=4, adaptive=False, threads=1)
    result = runner.generate(PROMPTS[1], chat=False, max_tokens=41, sampling=SamplingParams(temperature=0.0))
    assert result.stats.acceptance_per_position == [1.0, 1.0, 1.0, 1.0]
    assert result.stats.mean_accepted_length > 4.0
    # sampling with p == q also accepts everything (u < p/q = 1; a seed whose draws end in no end token, after
    # which the drafted tokens are not counted as accepted)
    sampled = runner.generate(PROMPTS[1], chat=False, max_tokens=41, sampling=SamplingParams(temperature=0.8, seed=4))
    assert sampled.finish_reason == "length"
    assert all(x == 1.0 for x in sampled.stats.acceptance_per_position)


def test_draft_model_cache_stays_consistent(tiny_artifact_with_draft):
    runner = Runner(tiny_artifact_with_draft, drafter="draft-model", num_draft_tokens=3, adaptive=False, threads=1)
    result = runner.generate(PROMPTS[0], chat=False, max_tokens=30)
    used = runner.drafter()
    history = runner.artifact.tokenizer.prompt_ids(PROMPTS[0], chat=False) + result.tokens
    fresh = Runner(tiny_artifact_with_draft, drafter="draft-model", threads=1).drafter()
    assert used.propose(history, Sizing(4)).tokens == fresh.propose(history, Sizing(4)).tokens
    # and after a rollback to an earlier prefix
    assert used.propose(history[:-7], Sizing(4)).tokens == fresh.propose(history[:-7], Sizing(4)).tokens


def test_sampled_speculative_is_seeded_and_valid(tiny_artifact):
    runner = Runner(tiny_artifact, drafter="ngram", num_draft_tokens=4, threads=1)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=7)
    a = runner.generate(PROMPTS[0], chat=False, max_tokens=32, sampling=params)
    b = runner.generate(PROMPTS[0], chat=False, max_tokens=32, sampling=params)
    assert a.tokens == b.tokens and len(a.tokens) == 32


def test_max_tokens_and_stop_inside_accepted_run(tiny_artifact):
    runner = Runner(tiny_artifact, drafter="ngram", num_draft_tokens=8, adaptive=False, threads=1)
    plain = runner.generate(PROMPTS[0], chat=False, max_tokens=60, drafter="none")
    for n in (1, 2, 7, 13):
        spec = runner.generate(PROMPTS[0], chat=False, max_tokens=n)
        assert spec.tokens == plain.tokens[:n]
        assert spec.finish_reason in ("length", "stop")
    text = plain.text
    stop = text[20:23] if len(text) > 25 else None
    if not stop:
        pytest.skip("tiny model produced too little text")
    spec = runner.generate(PROMPTS[0], chat=False, max_tokens=60, stop=[stop])
    assert spec.text == text[: text.find(stop)]
    assert spec.finish_reason == "stop"
    assert stop not in spec.text


def test_streaming_deltas_add_up(tiny_artifact):
    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    pieces: list[str] = []
    result = runner.generate(PROMPTS[2], chat=False, max_tokens=40, on_text=pieces.append)
    assert "".join(pieces) == result.text


def _clean_error(result, needle):
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and needle in last, last


def test_run_cli_json_and_bad_input(tiny_artifact, tmp_path):
    ok = run_cli("run", str(tiny_artifact), "--prompt", "abc abc", "--raw", "--max-tokens", "12", "--json", "--threads", "1")
    assert ok.returncode == 0, ok.stderr
    data = json.loads(ok.stdout)
    assert len(data["tokens"]) == 12 and {"text", "stats"} <= set(data)
    assert data["stats"]["target_passes"] >= 1
    if os.path.exists("/proc/self/status"):  # the process's memory (Linux): resident now, the peak at least that
        memory = data["memory"]
        assert 0 < memory["resident_mb"] <= memory["peak_mb"], memory
    art = str(tiny_artifact)
    _clean_error(run_cli("run", art, "--prompt", ""), "empty")
    _clean_error(run_cli("run", art, "--prompt", "hi", "--max-tokens", "0"), "--max-tokens")
    _clean_error(run_cli("run", art, "--prompt", "hi", "--max-tokens", "-3"), "--max-tokens")
    _clean_error(run_cli("run", art, "--prompt", "hi", "--temperature", "-1"), "--temperature")
    _clean_error(run_cli("run", art, "--prompt", "hi", "--top-p", "0"), "--top-p")
    _clean_error(run_cli("run", art, "--prompt", "hi", "--top-p", "1.5"), "--top-p")
    _clean_error(run_cli("run", art, "--prompt", "hi", "--drafter", "draft-model"), "exported without it")
    # another schema version
    other = tmp_path / "schema"
    shutil.copytree(tiny_artifact, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (other / "manifest.json").write_text(json.dumps(manifest))
    _clean_error(run_cli("run", str(other), "--prompt", "hi"), "schema_version 99")
    # a tampered file
    tampered = tmp_path / "tampered"
    shutil.copytree(tiny_artifact, tampered)
    with open(tampered / "target.onnx.data", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\x01\x02\x03\x04")
    _clean_error(run_cli("run", str(tampered), "--prompt", "hi"), "sha256")


def test_drafter_with_other_vocabulary_is_refused(tmp_path, tiny_model_dir):
    from conftest import write_char_tokenizer
    from speccompile.export.pipeline import ExportOptions, export_artifact

    other = make_tiny_hf_model(tmp_path / "other", seed=5, layers=1)
    write_char_tokenizer(other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["zz"] = vocab.pop("z")  # one entry differs
    (other / "tokenizer.json").write_text(json.dumps(tok))
    out = tmp_path / "out"
    with pytest.raises(InputError, match="tokenizer differs"):
        export_artifact(str(tiny_model_dir), out, ExportOptions(drafter=f"draft-model:{other}"))
    assert not out.exists()
    result = run_cli("export", str(tiny_model_dir), "--out", str(out), "--drafter", f"draft-model:{other}")
    _clean_error(result, "tokenizer differs")


def test_verify_and_bench_cli(tiny_artifact, tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps({"id": str(i), "prompt": p, "chat": False}) for i, p in enumerate(PROMPTS)))
    v = run_cli("verify", str(tiny_artifact), "--workload", str(workload), "--max-tokens", "24", "--threads", "1", "--json")
    assert v.returncode == 0, v.stderr
    assert json.loads(v.stdout)["identical"] is True
    b = run_cli("bench", str(tiny_artifact), "--workload", str(workload), "--max-tokens", "24", "--threads", "1", "--json", "--no-warmup")
    assert b.returncode == 0, b.stderr
    assert json.loads(b.stdout)["graph"] == "target.ort.onnx"
    assert json.loads(b.stdout)["verify_ms_by_q"]["1"] > 0  # the runner's measured pass costs: plain steps are q = 1
    report = json.loads(b.stdout)["workloads"]["w"]
    assert report["identical"] == len(PROMPTS)
    assert report["prompts"] == len(PROMPTS) and report["plain_tok_s"] > 0
    _clean_error(run_cli("bench", str(tiny_artifact), "--workload", str(tmp_path / "nope.jsonl")), "nope.jsonl")


def test_verify_compares_the_logits_bit_for_bit(tiny_artifact, monkeypatch):
    """`verify` checks the logits every token was chosen from, plain vs n-gram: bitwise equal on the fused CPU
    graph (its one-row passes get attention's padding row). Without that padding row the tokens still agree
    on this model, but the logits do not: the check sees what token identity hides."""
    from speccompile.runtime.backends.ort import OrtBufferSession
    from speccompile.runtime.bench import run_verify
    from speccompile.runtime.options import RunOptions

    options = RunOptions(drafter="ngram", threads=1, adaptive=False)  # drafts whenever the n-gram matches, whatever the timings
    report = run_verify(tiny_artifact, options, [], 24, None)
    assert report["identical"] and report["logits_bitwise"]
    for prompt in report["prompts"]:
        assert prompt["logit_positions"] == prompt["tokens"] and prompt["max_logit_difference"] == 0.0
    assert sum(p["mean_accepted_length"] > 1 for p in report["prompts"]) >= 2  # the n-gram drafts were verified
    monkeypatch.setattr(OrtBufferSession, "_padding_rows", lambda self, q, batch=1: 0)
    unpadded = run_verify(tiny_artifact, options, [], 24, None)
    assert not unpadded["logits_bitwise"]
    assert 0 < max(p["max_logit_difference"] for p in unpadded["prompts"]) < 1e-3


def test_artifact_errors(tmp_path):
    with pytest.raises(ArtifactError, match="not an artifact directory"):
        Runner(tmp_path / "nothing")


def test_tree_flag_needs_a_head_drafter(tiny_artifact):
    result = run_cli("run", str(tiny_artifact), "--prompt", "hi", "--drafter", "ngram", "--tree", "tree-2x4")
    _clean_error(result, "--tree")


def test_target_threads_spin_only_when_no_drafter_graph_runs(tiny_artifact, tiny_artifact_with_draft):
    """(allow spinning, stop spinning when a run returns) of the target's session."""
    from speccompile.runtime.options import RunOptions

    def spinning(runner) -> tuple[str, str]:
        options = runner.artifact.target.session.get_session_options()
        return (options.get_session_config_entry("session.intra_op.allow_spinning"),
                options.get_session_config_entry("session.force_spinning_stop"))

    assert spinning(Runner(tiny_artifact, drafter="ngram", threads=1)) == ("1", "0")
    assert spinning(Runner(tiny_artifact, drafter="none", threads=1)) == ("1", "0")
    # a draft-model graph alternates with the target on the same cores: no busy-waiting
    assert spinning(Runner(tiny_artifact_with_draft, drafter="auto", threads=1))[0] == "0"
    # a server: its event loop (and a slotted graph) take turns with the target: busy-waiting within a run only
    assert spinning(Runner(tiny_artifact, RunOptions(threads=1, shared_cores=True))) == ("1", "1")


def test_speculative_output_reaches_the_context_limit_like_plain(tiny_artifact):
    # near max_context a draft that does not fit is dropped (a plain step), not a reason to stop early
    from speccompile.runtime.drafters.base import Draft, Drafter
    from speccompile.runtime.generate import GenerationConfig

    class AlwaysDrafts(Drafter):  # a real (if poor) drafter: always k copies of the last token, so every draft is full length
        name = "repeat"

        def propose(self, tokens, sizing):
            return Draft([tokens[-1]] * sizing.room)

    runner = Runner(tiny_artifact, drafter="none", threads=1)
    ids = runner.artifact.tokenizer.prompt_ids(PROMPTS[0], chat=False)
    generator = runner.generator(plain=True)
    plain = generator.generate(ids, GenerationConfig(max_tokens=1000, num_draft_tokens=0, ignore_eos=True))
    # the last token is emitted from the logits of the last cache row, never fed back
    assert plain.finish_reason == "context" and len(ids) + len(plain.tokens) == runner.artifact.max_context + 1
    generator.drafter = AlwaysDrafts()
    spec = generator.generate(ids, GenerationConfig(max_tokens=1000, num_draft_tokens=8, adaptive=False, ignore_eos=True))
    assert spec.tokens == plain.tokens and spec.finish_reason == "context"
    assert spec.stats.draft_steps > 0

    class TwoWide(AlwaysDrafts):  # a tree with more nodes than its depth: two first-token candidates
        def propose(self, tokens, sizing):
            from speccompile.runtime.tree import TreeSpec

            return Draft([tokens[-1], (tokens[-1] + 1) % 50], tree=TreeSpec.from_choices([[0], [1]]))

    generator.drafter = TwoWide()
    spec = generator.generate(ids, GenerationConfig(max_tokens=1000, num_draft_tokens=1, adaptive=False, ignore_eos=True))
    assert spec.tokens == plain.tokens and spec.finish_reason == "context"


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=11)],
                         ids=["greedy", "seeded"])
def test_opening_text_is_the_first_delta_a_generation_streams(tiny_artifact, sampling):
    """`opening_text` (what a server sends at once for a prompt whose logits a prefix cache holds) is the
    generation's own first text delta; None where that is not fixed in advance."""
    from speccompile.runtime.generate import opening_text

    runner = Runner(tiny_artifact, threads=1)
    tokenizer, eos = runner.artifact.tokenizer, set(runner.artifact.eos_token_ids)
    checked: list[bool] = []  # per opening compared: whether its config had a stop string
    prompts = ("hello world", "abc abc abc", "The quick brown fox", "x y z")
    for prompt, stop in itertools.product(prompts, (None, ["\x07"])):  # a stop string the model never writes
        ids = tokenizer.prompt_ids(prompt, chat=False)
        config = runner.config(16, sampling, stop)
        deltas: list[str] = []
        generation = runner.generator(sampling).start(ids, config, deltas.append)
        opening = opening_text(tokenizer, eos, config, generation.prompt_logits)
        assert (opening is None) == (not deltas) or generation.done
        if opening is not None:
            checked.append(stop is not None)
            assert [opening] == deltas  # nothing else streamed before the first step
    assert len(checked) >= 3 and any(checked)
    logits = generation.prompt_logits
    assert opening_text(tokenizer, eos, runner.config(16, SamplingParams(temperature=0.9)), logits) is None  # unseeded
    assert opening_text(tokenizer, eos, runner.config(1, sampling), logits) is None  # the first token ends it


def test_a_runner_carries_draft_acceptance_across_generations(tiny_artifact):
    """The second generation's controller starts from what the first measured; outputs stay plain decoding's."""
    runner = Runner(tiny_artifact, drafter="ngram", num_draft_tokens=4, threads=1)
    learned = runner.learned_acceptance()
    assert not learned.observed
    plain = runner.generate(PROMPTS[0], chat=False, max_tokens=40, drafter="none")
    first = runner.generate(PROMPTS[0], chat=False, max_tokens=40)
    assert learned.observed and runner.learned_acceptance() is learned
    after_first = dict(learned.observed)
    second = runner.generate(PROMPTS[0], chat=False, max_tokens=40)
    assert first.tokens == second.tokens == plain.tokens
    assert learned.observed != after_first  # the second generation went on updating the same estimates
    assert runner.learned_acceptance(SamplingParams(temperature=0.7)) is not learned  # sampled drafts: their own
    assert runner.learned_acceptance(SamplingParams(seed=5)) is learned  # the seed changes no rate
    assert runner.generator(own_drafter=True).acceptance is None  # concurrent generations: each learns alone


@pytest.mark.parametrize("grow", [True, False])
def test_a_chain_accepted_whole_at_full_length_lets_the_next_round_grow(tiny_artifact, grow):
    """A single stream's drafter that `grows` (n-gram) may draft DRAFT_GROWTH x num_draft_tokens in the round after a
    chain of num_draft_tokens was accepted whole, and back to num_draft_tokens after any other verdict; a batch's
    generations (grow_drafts False) never exceed num_draft_tokens. The output stays plain decoding's."""
    from speccompile.runtime.drafters.base import Draft, Drafter
    from speccompile.runtime.generate import DRAFT_GROWTH, Generator
    from speccompile.runtime.options import GenerationConfig

    runner = Runner(tiny_artifact, drafter="ngram", threads=1)
    ids = runner.artifact.tokenizer.prompt_ids(PROMPTS[1], False)
    plain = list(runner.generate_ids(ids, max_tokens=60, drafter="none").tokens)

    class Oracle(Drafter):  # proposes plain decoding's next tokens, except one wrong token at a fixed place
        name, grows = "oracle", True

        def __init__(self):
            self.rooms: list[int] = []

        def propose(self, tokens, sizing):
            self.rooms.append(sizing.room)
            done = len(tokens) - len(ids)
            chain = plain[done: done + sizing.room]
            return Draft([t + 1 if done + i == 30 else t for i, t in enumerate(chain)])

    a, drafter, k = runner.artifact, Oracle(), 4
    generator = Generator(a.target, a.tokenizer, a.max_context, a.eos_token_ids, drafter, a.verify_rows, grow_drafts=grow)
    generation = generator.start(ids, GenerationConfig(max_tokens=60, num_draft_tokens=k, adaptive=False))
    while not generation.done:
        generation.step()
    assert list(generation.result().tokens) == plain and len(plain) > 40
    assert drafter.rooms[0] == k and max(drafter.rooms) == (DRAFT_GROWTH * k if grow else k)
    if grow:  # the round after the wrong token is back to k, the one after a whole grown chain grown again
        assert k in drafter.rooms[1:] and drafter.rooms.count(DRAFT_GROWTH * k) >= 2


def test_a_chat_prompt_for_a_model_without_a_chat_template_names_the_way_out(tiny_artifact, tmp_path):
    """A base model (no chat template): the chat default is refused in one line that says how to give the prompt
    raw (--raw; /v1/completions); the raw prompt goes through."""
    import json
    import shutil

    from speccompile.errors import InputError
    from speccompile.tokenizer import TextTokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_artifact / name, tmp_path / name)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = TextTokenizer(tmp_path)
    assert tokenizer.chat_template is None
    with pytest.raises(InputError, match="no chat template.*--raw.*/v1/completions"):
        tokenizer.prompt_ids("Hello", chat=True)
    assert tokenizer.prompt_ids("Hello", chat=False)
