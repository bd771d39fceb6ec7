"""Quantized artifacts on ONNX Runtime CPU: a verify pass reproduces one-token passes bit for bit, so
greedy speculative decoding is token-identical to plain decoding (one check per precision `build` writes
that ORT CPU runs: fp8, int4, fp8 weight-only, int4 of a Q4_1 GGUF stored on its own grid with offset branches,
int8 (blocks of 32 and, `--int8-block 64`, of 64), int8 of a Q5_0 / Q8_0 GGUF, int4 of a tied model's GGUF with
`--table-format int8-row`, whose lm_head runs as an integer product, and int4 in blocks of 16 (Q6_K's and Q3_K's
blocks, which the packed graph runs at 16); the int4 and int8 builds run as the packed fused
CPU graph)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from speccompile.manifest import read_manifest
from speccompile.runtime.artifact import open_artifact
from speccompile.runtime.backends.ort_quantized import quantized_session_config
from speccompile.runtime.session import Runner

from conftest import export_as_gguf, make_tiny_hf_model

CPU_SCHEMES = ["fp8", "int4", "fp8-weight-only", "int4-source-grid", "int8", "int8-source-grid", "int8-b64", "int4-row-table",
               "int4-b16"]
PACKED = {"int4", "int4-source-grid", "int8", "int8-source-grid", "int8-b64", "int4-row-table", "int4-b16"}  # run as the packed fused CPU graph (engines/cpu_graph.py)
# The source-grid builds' GGUF weights (the table Q8_0 in both): int8's a mixed file (Q5_0 for q / k, Q8_0 for the rest).
GGUF_TYPES = {"int4": "Q4_1", "int8": {"attn_q": "Q5_0", "attn_k": "Q5_0", "*": "Q8_0"}}
PROMPTS = ["abc abc abc abc abc", "the cat sat on the mat. the cat sat on the", "x = 1\ny = 2\nx = 1\ny ="]


@pytest.fixture(scope="module")
def quantized_with_draft(tiny_artifact_with_draft, tiny_model_dir, tiny_draft_dir, tmp_path_factory):
    """The tiny target (+ its draft model) built --onnx-only at each CPU precision; "*-source-grid" from the same
    model written as a Q4_1 (int4) or Q5_0 / Q8_0 (int8) GGUF (every weight on its grid); "int4-row-table" from a tied
    model's Q4_1 GGUF (a Q8_0 table) with its table requantized per row (`--table-format int8-row`)."""
    from speccompile.engines.build import BuildOptions, build_artifact

    root = tmp_path_factory.mktemp("quantexact")
    built = {}
    for scheme in CPU_SCHEMES:
        built[scheme] = root / scheme
        precision, _, variant = scheme.partition("-")
        source = tiny_artifact_with_draft
        if variant in ("source-grid", "row-table"):
            model = make_tiny_hf_model(root / "tied", tie_word_embeddings=True) if variant == "row-table" else tiny_model_dir
            source = export_as_gguf(root / f"gguf-{scheme}", model, drafter=f"draft-model:{tiny_draft_dir}",
                                    quant=GGUF_TYPES[precision], table_quant="Q8_0")
        tables = {"source-grid": {"quantize_tables": True, "exclude": ()},
                  "row-table": {"quantize_tables": True, "exclude": (), "table_format": "int8-row"}}.get(variant, {})
        build_artifact(source, built[scheme], BuildOptions(precision=precision, onnx_only=True, calib_samples=3, calib_max_tokens=64,
                                                           weight_only=variant == "weight-only", int8_block=64 if variant == "b64" else 32,
                                                           int4_block=16 if variant == "b16" else 128,
                                                           **tables))
        if variant == "source-grid":  # every MatMul (lm_head too) and the table on its own grid
            record = read_manifest(built[scheme]).precision["target"]
            assert record["source_grid"]["weights"] == record["quantized_matmuls"] + 1
            assert (record["source_grid"]["with_offset"] > 0) == (precision == "int4")  # Q4_1 has offsets, Q5_0 / Q8_0 none
    yield built
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
def test_int_builds_run_packed_on_the_cpu(quantized_with_draft, scheme):
    """INT4 / INT8 builds open as the fused CPU graph with packed weights; FP8 ones as the Q/DQ contract graph."""
    spec = open_artifact(quantized_with_draft[scheme], drafter="none").target.spec
    assert (spec.file == "target.ort.onnx") == (scheme in PACKED)
    if scheme in PACKED:
        assert spec.extra["cpu_kernels"]["MatMulNBits"] > 0
        wide = scheme in ("int8-b64", "int4-row-table")  # 8 bits on blocks of 64 (the tiny table's rows: one block of 64)
        assert spec.extra["cpu_kernels"].get("wide_block") == (64 if wide else None)
        assert spec.extra["cpu_kernels"].get("MatMulInteger") == (1 if scheme == "int4-row-table" else None)  # the tied head
        assert spec.extra["cpu_kernels"].get("fine_block") == (16 if scheme == "int4-b16" else None)  # runs at blocks of 16
    graphs = read_manifest(quantized_with_draft[scheme]).graphs  # the draft model's fused CPU graph stays (not quantized)
    assert any(g.extra.get("variant_of") == graphs["draft"].file for g in graphs.values()), sorted(graphs)
    from speccompile.runtime.costs import PACKED_CPU_SLOPE, SEEDED_SLOPE
    from speccompile.runtime.sampling import SamplingParams

    seeded = Runner(quantized_with_draft[scheme], drafter="ngram").generator(SamplingParams(temperature=1.0, seed=3)).seeded_costs
    assert seeded.slope == (PACKED_CPU_SLOPE if scheme in PACKED else SEEDED_SLOPE)  # seeded drafts priced by the graph


def _causal(q: int) -> np.ndarray:
    return np.tril(np.ones((q, q), bool))


def _prefilled(target, ids: np.ndarray):
    """A cache holding `ids` (one prompt pass)."""
    cache = target.new_cache()
    out = target.run(ids, np.arange(len(ids)), cache.attention_mask(_causal(len(ids))), cache)
    cache.append(out.presents, list(range(len(ids))), len(ids))
    return cache


def _passes(target, ids: np.ndarray, prefix: int, step: int) -> np.ndarray:
    """Logits of ids[prefix:] computed `step` tokens per pass after a prefix pass (later rows read the KV
    rows earlier passes wrote, so equal logits also mean equal KV)."""
    cache = _prefilled(target, ids[:prefix])
    rows = []
    for start in range(prefix, len(ids), step):
        q = min(step, len(ids) - start)
        out = target.run(ids[start:start + q], np.arange(start, start + q), cache.attention_mask(_causal(q)), cache)
        cache.append(out.presents, list(range(q)), q)
        rows.append(out.logits)
    return np.concatenate(rows)


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
def test_row_logits_do_not_depend_on_the_number_of_rows(quantized_with_draft, scheme):
    art = open_artifact(quantized_with_draft[scheme], threads=2, drafter="none")
    assert art.target.spec.extra["quantization"] == scheme.partition("-")[0]
    ids = np.array([5, 9, 20, 31, 7, 12, 40, 3, 22, 17, 8, 61, 33, 4], dtype=np.int64)
    one = _passes(art.target, ids, prefix=4, step=1)
    for step in (3, 10):  # chains of drafts verified together, like a speculative step
        many = _passes(art.target, ids, prefix=4, step=step)
        assert np.array_equal(one, many), (step, float(np.abs(one - many).max()))


@pytest.mark.parametrize("scheme", [*CPU_SCHEMES, "fp32-contract"])
def test_rejected_rows_leave_no_trace(quantized_with_draft, tiny_artifact_with_draft, scheme):
    """After a verify pass whose drafts were all rejected, the next token gets a plain step's logits."""
    path = tiny_artifact_with_draft if scheme == "fp32-contract" else quantized_with_draft[scheme]
    art = open_artifact(path, threads=2, fused=False, drafter="none")
    target = art.target
    ids = np.array([5, 9, 20, 31, 7, 12, 40, 3, 22, 17, 8, 61, 33, 4, 50, 27, 11, 19, 44], dtype=np.int64)
    p = len(ids) - 2
    plain, spec = _prefilled(target, ids[:p]), _prefilled(target, ids[:p])
    out = target.run(ids[p:p + 1], np.array([p]), plain.attention_mask(_causal(1)), plain)
    plain.append(out.presents, [0], 1)
    drafts = np.array([ids[p], 70, 71, 72])  # three drafts the verifier rejects
    out = target.run(drafts, np.arange(p, p + 4), spec.attention_mask(_causal(4)), spec)
    spec.append(out.presents, [0], 4)
    spec.maybe_compact(1, art.max_context)  # what the generation loop does before every pass
    expected = target.run(ids[p + 1:], np.array([p + 1]), plain.attention_mask(_causal(1)), plain).logits
    got = target.run(ids[p + 1:], np.array([p + 1]), spec.attention_mask(_causal(1)), spec).logits
    assert np.array_equal(expected, got), float(np.abs(expected - got).max())


@pytest.mark.parametrize("scheme", CPU_SCHEMES)
@pytest.mark.parametrize("drafter", ["ngram", "draft-model"])
def test_greedy_speculative_equals_plain(quantized_with_draft, scheme, drafter):
    runner = Runner(quantized_with_draft[scheme], drafter=drafter, num_draft_tokens=4, adaptive=False, threads=2)
    assert runner.drafter_name == drafter
    assert_greedy_speculative_equals_plain(runner, PROMPTS, 40)


def assert_greedy_speculative_equals_plain(runner: Runner, prompts: list[str], max_tokens: int) -> None:
    """Each prompt's greedy tokens with the runner's drafter equal plain decoding's (tests/test_moe.py too)."""
    draft_steps = 0
    for prompt in prompts:
        plain = runner.generate(prompt, chat=False, max_tokens=max_tokens, drafter="none")
        spec = runner.generate(prompt, chat=False, max_tokens=max_tokens)
        assert spec.tokens == plain.tokens, prompt
        draft_steps += spec.stats.draft_steps
    assert draft_steps > 0  # multi-row verify passes really ran (a rejected draft's pass still emits a token)


def test_tensorrt_keeps_the_qdq_nodes(quantized_with_draft):
    spec = open_artifact(quantized_with_draft["fp8"], drafter="none").target.spec
    assert quantized_session_config(spec, "ort-cpu") == {"session.disable_quant_qdq": "1"}
    assert quantized_session_config(spec, "ort-trt") == {}  # TensorRT fuses the Q/DQ into FP8 GEMMs itself
