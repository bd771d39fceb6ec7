"""The request fields OpenAI and vLLM clients send: penalties, logit bias and min-p exact under speculation (greedy
identical to plain, sampled distributed as the penalised target), and the server's n, echo and prompt lists.

The distribution test follows tests/test_sampling.py: a synthetic Markov "model" over 8 tokens, the first 3 tokens
of many seeded speculative generations, a chi-square test against the exact joint distribution of the penalised
target (history-dependent, enumerated). Each round adjusts the pass's rows with `LogitPenalties.apply` and the
rows' `draft_paths` and verifies them with the real `verify_draft`, as runtime/generate.py does.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from speccompile.errors import InputError
from speccompile.runtime import Runner
from speccompile.runtime.backends.base import StepOutput
from speccompile.runtime.drafters.base import Draft
from speccompile.runtime.penalties import LogitPenalties, draft_paths
from speccompile.runtime.sampling import SamplingParams, process_logits, sample
from speccompile.runtime.tree import TreeSpec
from speccompile.runtime.verification import verify_draft

from test_sampling import chi_square_p_value, model_logits

PROMPTS = ["abc abc abc abc abc", "the cat sat on the mat. the cat sat on the", "x = 1\ny = 2\nx = 1\ny ="]
PENALTIES = {
    "presence": LogitPenalties(presence=0.3),
    "negative presence": LogitPenalties(presence=-0.5),  # repeats favoured: long accepted runs
    "frequency": LogitPenalties(frequency=0.2),
    "repetition": LogitPenalties(repetition=1.2),
    "repetition < 1": LogitPenalties(repetition=0.8),
    "logit_bias": LogitPenalties(logit_bias=((4, 6.0), (3, -100.0))),  # "a" up, " " banned (conftest ids)
    "all": LogitPenalties(presence=0.2, frequency=0.1, repetition=1.1, logit_bias=((40, 3.0),)),
}


# --------------------------------------------------------------------------------------------
# The adjustment itself
# --------------------------------------------------------------------------------------------


def reference_adjust(row: np.ndarray, prompt: list[int], output: list[int], penalties: LogitPenalties) -> np.ndarray:
    """One row, written out token by token: bias, then repetition (prompt or output), frequency, presence (output)."""
    out = row.astype(np.float64).copy()
    for token, bias in penalties.logit_bias:
        out[token] += bias
    for token in set(prompt) | set(output):
        out[token] = out[token] / penalties.repetition if out[token] > 0 else out[token] * penalties.repetition
    for token in set(output):
        out[token] -= penalties.frequency * output.count(token) + penalties.presence
    return out


def test_adjustment_matches_the_reference_row_by_row():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 12)).astype(np.float32) * 3
    penalties = LogitPenalties(presence=0.4, frequency=0.3, repetition=1.5, logit_bias=((7, 2.5), (0, -1.0)))
    prompt, output = [1, 2, 2, 9], [3, 3, 5]
    tree = TreeSpec.from_parents([-1, 0, 0, 1])  # rows: pending, two children of it, a grandchild under the first
    draft = [5, 11, 3]
    paths = draft_paths(4, draft, tree.parents)
    assert paths == [[], [5], [11], [5, 3]]
    assert draft_paths(4, draft, None) == [[], [5], [5, 11], [5, 11, 3]]
    adjusted = penalties.apply(logits, prompt, output, paths)
    for row, path in enumerate(paths):
        np.testing.assert_allclose(adjusted[row], reference_adjust(logits[row], prompt, output + path, penalties),
                                   rtol=1e-5, atol=1e-5)
    assert not LogitPenalties().active and LogitPenalties(repetition=1.1).active


@pytest.mark.parametrize("penalties,message", [
    (LogitPenalties(presence=2.5), "presence_penalty must be in [-2, 2]"),
    (LogitPenalties(frequency=float("nan")), "frequency_penalty must be in [-2, 2]"),
    (LogitPenalties(repetition=0.0), "repetition_penalty must be > 0"),
    (LogitPenalties(logit_bias=((3, 101.0),)), "logit_bias: the bias of token 3 must be in [-100, 100]"),
    (LogitPenalties(logit_bias=((96, 1.0),)), "logit_bias: token id 96 is outside the vocabulary (0..95)"),
])
def test_penalties_validate(penalties, message):
    with pytest.raises(InputError) as err:
        penalties.validate(96)
    assert str(err.value).startswith(message)


def test_min_p_keeps_tokens_at_least_min_p_of_the_best():
    logits = np.log(np.array([[0.5, 0.3, 0.12, 0.08]]))
    probs = process_logits(logits, SamplingParams(temperature=1.0, min_p=0.2))
    np.testing.assert_allclose(probs, [[0.5 / 0.92, 0.3 / 0.92, 0.12 / 0.92, 0.0]])
    same = process_logits(logits, SamplingParams(temperature=1.0, top_k=3, min_p=0.2))
    np.testing.assert_allclose(same, probs)
    with pytest.raises(InputError, match="min_p must be in"):
        SamplingParams(temperature=1.0, min_p=1.5).validate()


# --------------------------------------------------------------------------------------------
# Sampled exactness: a history-dependent penalised target over 8 tokens
# --------------------------------------------------------------------------------------------

V, T, N = 8, 3, 20_000
PROMPT = [3, 1, 3]
P_PARAMS = SamplingParams(temperature=0.9, min_p=0.02)
SAMPLED_PENALTIES = LogitPenalties(presence=0.6, frequency=0.7, repetition=1.4, logit_bias=((2, 1.2), (4, -1.5)))


def penalised_probs(target: np.ndarray, history: list[int], penalties: LogitPenalties) -> np.ndarray:
    """The exact next-token distribution after `history` (PROMPT + output) of the penalised Markov target."""
    row = penalties.apply(target[history[-1]], PROMPT, history[len(PROMPT):], [[]])
    return process_logits(row, P_PARAMS)[0]


def exact_penalised_joint(target: np.ndarray, penalties: LogitPenalties) -> np.ndarray:
    joint = np.zeros([V] * T)
    for seq in itertools.product(range(V), repeat=T):
        p, history = 1.0, list(PROMPT)
        for token in seq:
            p *= penalised_probs(target, history, penalties)[token]
            history.append(token)
        joint[seq] = p
    return joint


def speculative_counts(draft_kind: str, seed: int, respect_paths: bool = True) -> np.ndarray:
    """Counts of the first T tokens of N speculative generations: each round drafts from the draft table (a sampled
    chain with its q, the argmax chain, or a deterministic top-2 tree), adjusts the pass rows and verifies."""
    target, draft_logits = model_logits(seed=3)
    q_table = process_logits(draft_logits, SamplingParams(temperature=1.0))
    order = np.argsort(-q_table, axis=1, kind="stable")
    tree = TreeSpec.from_choices([[0], [1], [0, 0], [0, 1], [1, 0]])
    rng = np.random.default_rng(seed)
    rows_cache: dict = {}
    counts = np.zeros(V**T, dtype=np.int64)
    for _ in range(N):
        output: list[int] = [sample(penalised_probs(target, PROMPT, SAMPLED_PENALTIES), rng)]  # the first token
        while len(output) < T:
            last = output[-1]
            if draft_kind == "soft":
                tokens, probs = [], []
                for _ in range(2):
                    q = q_table[tokens[-1] if tokens else last]
                    tokens.append(sample(q, rng))
                    probs.append(q)
                draft = Draft(tokens, probs=np.stack(probs))
            elif draft_kind == "argmax":
                draft = Draft([int(order[last, 0]), int(order[order[last, 0], 0])])
            else:
                node_tokens = [last]
                for i in range(1, tree.n):
                    node_tokens.append(int(order[node_tokens[tree.parents[i]], tree.choice[i]]))
                draft = Draft(node_tokens[1:], tree=tree)
            key = (tuple(output), tuple(draft.tokens), draft_kind)
            if key not in rows_cache:
                ids = [last, *draft.tokens]
                paths = draft_paths(len(ids), draft.tokens, None if draft.tree is None else draft.tree.parents)
                if not respect_paths:  # the negative control: every row sees the history before the pass
                    paths = [[] for _ in paths]
                rows_cache[key] = SAMPLED_PENALTIES.apply(target[ids], PROMPT, output, paths)
            verdict = verify_draft(draft, last, StepOutput(rows_cache[key], []), P_PARAMS, rng)
            output += verdict.tokens
        code = 0
        for token in output[:T]:
            code = code * V + token
        counts[code] += 1
    return counts


@pytest.mark.parametrize("draft_kind", ["soft", "argmax", "tree"])
def test_sampled_speculation_is_distributed_as_the_penalised_target(draft_kind):
    joint = exact_penalised_joint(model_logits(seed=3)[0], SAMPLED_PENALTIES)
    counts = speculative_counts(draft_kind, seed=11)
    p_value = chi_square_p_value(counts, joint)
    assert p_value > 1e-3, f"chi-square p-value {p_value:.3g}: not distributed as the penalised target"


@pytest.mark.parametrize("draft_kind", ["soft", "tree"])
def test_the_chi_square_sees_penalties_that_ignore_the_draft_path(draft_kind):
    joint = exact_penalised_joint(model_logits(seed=3)[0], SAMPLED_PENALTIES)
    counts = speculative_counts(draft_kind, seed=11, respect_paths=False)
    assert chi_square_p_value(counts, joint) < 1e-6


# --------------------------------------------------------------------------------------------
# Greedy on the real runtime: speculative == plain, plain == the reference rule
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ngram_runner(tiny_artifact):
    return Runner(tiny_artifact, drafter="ngram", num_draft_tokens=5, adaptive=False, threads=1)


@pytest.mark.parametrize("case", list(PENALTIES))
def test_greedy_ngram_with_penalties_equals_plain(ngram_runner, case, monkeypatch):
    runner, penalties = ngram_runner, PENALTIES[case]
    seen: list[tuple[np.ndarray, list[int], list[list[int]]]] = []
    original = LogitPenalties.apply

    def recording(self, logits, prompt, output, paths):
        seen.append((np.array(logits, dtype=np.float32, ndmin=2), list(prompt) + list(output), [list(p) for p in paths]))
        return original(self, logits, prompt, output, paths)

    changed, accepted = 0, 0
    for text in PROMPTS:
        ids = runner.artifact.tokenizer.prompt_ids(text, chat=False)
        monkeypatch.setattr(LogitPenalties, "apply", recording)
        plain = runner.generate_ids(ids, 40, drafter="none", penalties=penalties)
        monkeypatch.setattr(LogitPenalties, "apply", original)
        spec = runner.generate_ids(ids, 40, penalties=penalties)
        assert spec.tokens == plain.tokens, text
        accepted += sum(spec.stats.accepted)
        changed += runner.generate_ids(ids, 40, drafter="none").tokens != plain.tokens
        # plain decoding chose each token by the reference rule over the prompt and everything generated before it
        history = list(ids)
        for (raw, before, paths), token in zip(seen, plain.tokens):
            assert before == history and paths == [[]]
            reference = reference_adjust(raw[0], ids, history[len(ids):], penalties)
            assert token == int(np.argmax(reference))
            history.append(token)
        seen.clear()
    assert changed > 0  # the penalty changed the output
    assert accepted > 0  # drafts were accepted under it


def test_greedy_draft_model_with_penalties_equals_plain(tiny_artifact_with_draft):
    runner = Runner(tiny_artifact_with_draft, drafter="draft-model", num_draft_tokens=3, adaptive=False, threads=1)
    for text in PROMPTS[:2]:
        ids = runner.artifact.tokenizer.prompt_ids(text, chat=False)
        plain = runner.generate_ids(ids, 32, drafter="none", penalties=PENALTIES["all"])
        spec = runner.generate_ids(ids, 32, penalties=PENALTIES["all"])
        assert spec.tokens == plain.tokens and spec.stats.draft_steps > 0


def test_batched_penalties_and_seeds_equal_alone(ngram_runner):
    """Batch slots with penalties (greedy and seeded sampling with min-p) decode as each request alone."""
    runner = ngram_runner
    requests = []
    for i, text in enumerate(PROMPTS):
        ids = runner.artifact.tokenizer.prompt_ids(text, chat=False)
        requests.append((ids, SamplingParams(), PENALTIES["all"]))
        requests.append((ids, SamplingParams(temperature=0.8, min_p=0.1, seed=i), PENALTIES["frequency"]))
    decoder = runner.batch_decoder(len(requests))
    generations = decoder.join_many([(ids, runner.config(24, s, penalties=p), None) for ids, s, p in requests])
    while decoder.active:
        decoder.step()
    assert decoder.batched_passes > 0
    for (ids, sampling, penalties), generation in zip(requests, generations):
        assert generation.result().tokens == runner.generate_ids(ids, 24, sampling, penalties=penalties).tokens


@pytest.mark.parametrize("penalties", [LogitPenalties(logit_bias=((30, 100.0),)), LogitPenalties(repetition=3.0)])
def test_opening_text_applies_the_penalties(ngram_runner, penalties):
    """What a server sends at once for a cached prompt is the generation's own first delta, penalised alike."""
    from speccompile.runtime.generate import opening_text

    runner = ngram_runner
    tokenizer, eos = runner.artifact.tokenizer, set(runner.artifact.eos_token_ids)
    for text in PROMPTS:
        ids = tokenizer.prompt_ids(text, chat=False)
        config = runner.config(8, SamplingParams(), penalties=penalties)
        deltas: list[str] = []
        generation = runner.generator(config.sampling).start(ids, config, deltas.append)
        assert [opening_text(tokenizer, eos, config, generation.prompt_logits, ids)] == deltas
        if penalties.logit_bias:
            assert deltas == ["A"]  # token 30 (conftest's ids), pushed up by 100


# --------------------------------------------------------------------------------------------
# The server through the `openai` client
# --------------------------------------------------------------------------------------------

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_artifact):
    from conftest import load_benchmark

    process = load_benchmark("server_process").ServerProcess(tiny_artifact, "--served-model-name", MODEL, "--threads", "1",
                                                            "--max-concurrency", "4")
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def runner(tiny_artifact) -> Runner:
    return Runner(tiny_artifact, threads=1)


def _ids(runner: Runner, text: str) -> list[int]:
    return runner.artifact.tokenizer.prompt_ids(text, chat=False)


def _text(runner: Runner, ids: list[int], max_tokens: int, sampling: SamplingParams | None = None,
          penalties: LogitPenalties | None = None) -> str:
    return runner.generate_ids(ids, max_tokens, sampling, penalties=penalties).text


def test_n_choices_are_seeded_per_choice_and_share_the_prefill(client, runner):
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat"
    ids = _ids(runner, prompt)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.9, seed=7, n=3)
    assert [c.index for c in response.choices] == [0, 1, 2]
    expected = [_text(runner, ids, 12, SamplingParams(temperature=0.9, seed=7 + i)) for i in range(3)]
    assert [c.text for c in response.choices] == expected
    assert len(set(expected)) > 1  # distinct seeds, distinct answers
    completion = sum(len(runner.generate_ids(ids, 12, SamplingParams(temperature=0.9, seed=7 + i)).tokens) for i in range(3))
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == completion
    cached = [c.model_extra["speculative"]["cached_tokens"] for c in response.choices]
    assert cached.count(len(ids)) >= 2  # choices after the first start from its prefill (the prefix cache)


def test_chat_n_streams_every_choice(client):
    messages = [{"role": "user", "content": "abc abc abc"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.8, seed=3, n=2)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0.8, seed=3, n=2,
                                            stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("fields,penalties", [
    ({"presence_penalty": 0.3, "frequency_penalty": 0.2}, LogitPenalties(presence=0.3, frequency=0.2)),
    ({"extra_body": {"repetition_penalty": 1.2}}, LogitPenalties(repetition=1.2)),
    ({"logit_bias": {"4": 6, "3": -100}}, LogitPenalties(logit_bias=((3, -100.0), (4, 6.0)))),
])
def test_penalties_and_logit_bias_through_the_client_equal_plain(client, runner, fields, penalties):
    prompt = "abc abc abc abc abc"
    ids = _ids(runner, prompt)
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, **fields)
    plain = runner.generate_ids(ids, 24, drafter="none", penalties=penalties).text
    assert response.choices[0].text == plain != runner.generate_ids(ids, 24, drafter="none").text
    sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.9, seed=5,
                                        **{**fields, "extra_body": {**fields.get("extra_body", {}), "min_p": 0.1}})
    assert sampled.choices[0].text == _text(runner, ids, 16, SamplingParams(temperature=0.9, seed=5, min_p=0.1), penalties)


def _prompt_logprobs(runner: Runner, ids: list[int]) -> list[float]:
    """Each prompt token's log-probability after the tokens before it: the last logits of a prefill of that prefix."""
    out = []
    for i in range(1, len(ids)):
        logits = runner.generator(SamplingParams(temperature=1.0)).start(ids[:i], runner.config(1, SamplingParams(1.0))).prompt_logits
        shifted = logits.astype(np.float64) - logits.max()
        out.append(float(shifted[ids[i]] - np.log(np.exp(shifted).sum())))
    return out


def test_echo_and_prompt_lists(client, runner):
    prompts = ["abc abc", "x = 1\ny ="]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0.7, seed=1, n=2,
                                         echo=True, logprobs=1)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        prompt = prompts[choice.index // 2]
        ids = _ids(runner, prompt)
        answer = _text(runner, ids, 6, SamplingParams(temperature=0.7, seed=1 + choice.index % 2))
        assert choice.text == prompt + answer
        columns = choice.logprobs
        assert len(columns.tokens) == len(ids) + len(runner.generate_ids(ids, 6, SamplingParams(temperature=0.7, seed=1 + choice.index % 2)).tokens)
        assert columns.token_logprobs[0] is None and columns.top_logprobs[0] is None
        assert columns.token_logprobs[1:len(ids)] == pytest.approx(_prompt_logprobs(runner, ids), abs=1e-4)
        assert all(len(top) == 1 for top in columns.top_logprobs[1:])
    by_ids = client.completions.create(model=MODEL, prompt=[_ids(runner, p) for p in prompts], max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [_text(runner, _ids(runner, p), 6) for p in prompts]
    assert by_ids.usage.prompt_tokens == sum(len(_ids(runner, p)) for p in prompts)
    streamed = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=6, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == prompts[0] + _text(runner, _ids(runner, prompts[0]), 6)
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=6, temperature=0, echo=True,
                                            logprobs=0, stream=True))
    assert chunks[0].choices[0].text == prompts[0]
    lead = chunks[0].choices[0].logprobs.token_logprobs
    assert lead[0] is None and lead[1:] == pytest.approx(_prompt_logprobs(runner, _ids(runner, prompts[0])), abs=1e-4)


def test_n_choices_on_the_sequential_engine(tiny_artifact, runner):
    """--no-batching: the choices are generations one after another, seeded alike."""
    import openai

    from conftest import load_benchmark

    process = load_benchmark("server_process").ServerProcess(tiny_artifact, "--served-model-name", MODEL, "--threads", "1",
                                                            "--no-batching")
    try:
        client = openai.OpenAI(base_url=process.url, api_key="unused", max_retries=0, timeout=120)
        prompt = "abc abc abc"
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=2, n=2,
                                             presence_penalty=0.5)
        ids = _ids(runner, prompt)
        assert [c.text for c in response.choices] == [
            _text(runner, ids, 8, SamplingParams(temperature=1.0, seed=2 + i), LogitPenalties(presence=0.5)) for i in range(2)]
    finally:
        assert process.stop() == 0


@pytest.mark.parametrize("body,param", [
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"96": 1}}, "logit_bias"),
    ({"logit_bias": {"7": 1, "007": 2}}, "logit_bias"),
    ({"prompt": ["abc", ""]}, "prompt"),
    ({"echo": "maybe"}, "echo"),
    ({"n": 20}, "n"),  # more choices than the server admits at once (4 + its queue of 64 is fine; 20 x 4 prompts is not)
])
def test_out_of_range_fields_are_400_naming_them(server, body, param):
    import httpx

    request = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **body}
    if param == "n" and body["n"] == 20:
        request["prompt"] = ["a", "b", "c", "d"]
    response = httpx.post(server.url + "/completions", json=request, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def medusa_artifact(tmp_path_factory):
    """The tiny head target with random Medusa heads: its trees carry the n-gram lookup branch (accepted on
    repetitive text), so verify passes over trees with accepted paths."""
    from test_heads_helpers import shared_target, write_checkpoint

    from speccompile.export.pipeline import ExportOptions, export_artifact

    root = tmp_path_factory.mktemp("fields_medusa")
    ckpt = write_checkpoint(root / "ckpt", "medusa")
    export_artifact(str(shared_target(tmp_path_factory)), root / "medusa", ExportOptions(drafter=f"medusa:{ckpt}", max_context=256))
    return root / "medusa"


def test_greedy_tree_drafts_with_penalties_equal_plain(medusa_artifact):
    """Tree verify passes (random Medusa heads under the lookup branch) with penalties that change the output: greedy
    identical to plain. (Random heads are accepted at the first level only; deeper paths: the chi-square above.)"""
    runner = Runner(medusa_artifact, drafter="medusa", adaptive=False, threads=1)
    trees, accepted, changed = 0, 0, 0
    for penalties in (LogitPenalties(frequency=0.5), LogitPenalties(presence=1.5, logit_bias=((40, 2.0),))):
        for seed in range(2):
            ids = [int(t) for t in np.random.default_rng(seed).integers(3, 60, size=5)] * 4
            plain = runner.generate_ids(ids, 32, drafter="none", penalties=penalties)
            spec = runner.generate_ids(ids, 32, penalties=penalties)
            assert spec.tokens == plain.tokens, (penalties, seed)
            assert spec.stats.drafted[1:] and max(spec.stats.drafted[1:]) > 0  # trees deeper than one level
            trees += spec.stats.draft_steps
            accepted += sum(spec.stats.accepted)
            changed += plain.tokens != runner.generate_ids(ids, 32, drafter="none").tokens
    assert trees > 0 and accepted > 0 and changed > 0
