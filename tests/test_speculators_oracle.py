"""EAGLE-3 heads made by the `speculators` library (its own classes, random weights, save_pretrained) and written in
the EAGLE authors' and SGLang SpecForge's layouts load here; our exported head graph drafts the same tokens as the
library's own torch forward on the same target features, with the same distributions within 1e-4, at every
draft step; exported with the target (which returns the taps each head asks for), greedy speculative == plain.

Needs the library in a venv of its own (its pins differ from ours): scripts/setup_oracles.sh, then
SPECCOMPILE_SPECULATORS_PYTHON=/tmp/spec-venv/bin/python. Skipped without it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from test_heads_helpers import shared_target

SPEC_PY = os.environ.get("SPECCOMPILE_SPECULATORS_PYTHON", "")
SCRIPT = Path(__file__).parent / "oracles" / "speculators_heads.py"
pytestmark = pytest.mark.skipif(not Path(SPEC_PY).is_file(), reason="set SPECCOMPILE_SPECULATORS_PYTHON to the python of "
                                "a venv with `speculators` (scripts/setup_oracles.sh)")

# head -> (layout read, taps as layer inputs, draft layers); the tiny target has 8 layers
HEADS = {
    "spec_llama": ("eagle3/speculators", [2, 4, 5], 1),
    "spec_qwen3_2layers": ("eagle3/speculators", [1, 3, 6], 2),
    "spec_llama_3layers_4taps": ("eagle3/speculators", [0, 3, 5, 8], 3),
    "eagle_authors": ("eagle3/flat (EAGLE authors' pytorch_model.bin)", [2, 4, 5], 1),
    "specforge_sharded": ("eagle3/flat (taps as layer outputs: SGLang SpecForge, ModelOpt)", [1, 4, 7], 1),
}
# the library's MTP modules (it builds Qwen3-style layers only) -> layer kind
MTP_HEADS = {"spec_mtp": "qwen3", "spec_mtp_seed7": "qwen3", "spec_mtp_seed8": "qwen3"}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    import torch

    from speccompile.models.load import load_model

    torch.set_num_threads(1)
    target = shared_target(tmp_path_factory)
    out = tmp_path_factory.mktemp("speculators_heads")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own packages, not this checkout's
    done = subprocess.run([SPEC_PY, str(SCRIPT), str(target), str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == sorted(HEADS)
    assert all((out / name / "oracle.npz").is_file() for name in MTP_HEADS)
    return target, load_model(str(target)), out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def teacher_forced_drafts(session, head, features: np.ndarray, ids: np.ndarray, steps: int) -> np.ndarray:
    """The head graph's logits [steps, rows, draft vocab] as the library's training forward computes them: step 0
    over the committed rows (the target's features), step s feeds each row's step s-1 output and the token s
    places later, seeing the committed rows up to its own and its own earlier draft rows."""
    rows = len(ids)
    cfg = head.head_config
    names = [i.name for i in session.get_inputs()]
    past = [np.zeros((1, cfg.layer.num_key_value_heads, 0, cfg.layer.head_dim), np.float32) for _ in range(2 * head.num_layers)]
    hidden = np.zeros((rows, cfg.layer.hidden_size), np.float32)
    aux = features.astype(np.float32)
    causal = np.tril(np.ones((rows, rows), bool))
    eye = np.eye(rows, dtype=bool)
    out = []
    for s in range(steps):
        tokens = np.zeros(rows, np.int64)
        tokens[: rows - s] = ids[s:]
        mask = np.concatenate([causal] + [eye] * s, axis=1)[None]
        feed = {"input_ids": tokens[None], "position_ids": (np.arange(rows) + s)[None], "attention_mask": mask,
                "aux_hidden_states": aux[None], "hidden_states": hidden[None]}
        feed.update({n: p for n, p in zip([n for n in names if n.startswith("past_key_values")], past)})
        result = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
        out.append(result["logits"][0])
        past = [result[n.replace("past_key_values", "present")] for n in names if n.startswith("past_key_values")]
        hidden = result["draft_hidden_states"][0]
        aux = np.zeros_like(aux)
    return np.stack(out)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_our_graph_drafts_as_the_library(name, fixtures, tmp_path):
    import onnxruntime as ort

    from speccompile.export.heads import export_head_graph
    from speccompile.models.head_loaders import load_head

    _, model, out = fixtures
    layout, taps, layers = HEADS[name]
    head = load_head("eagle3", out / name, model.config, model.weights)
    cfg = head.head_config
    assert (cfg.layout, cfg.aux_layer_ids, cfg.num_layers) == (layout, taps, layers)
    export_head_graph(head, tmp_path / "eagle3.onnx")
    session = ort.InferenceSession(str(tmp_path / "eagle3.onnx"), providers=["CPUExecutionProvider"])
    ref = np.load(out / name / "oracle.npz")
    steps = ref["logits"].shape[0]
    ours = teacher_forced_drafts(session, head, ref["features"], ref["input_ids"], steps)
    rows = ours.shape[1]
    for s in range(steps):
        live = rows - s  # the library pads the last s rows' ids with 0: compared too (same inputs)
        np.testing.assert_allclose(_softmax(ours[s][:live]), _softmax(ref["logits"][s][:live]), atol=1e-4, rtol=0)
        d2t = head.draft_to_target().numpy()
        assert np.array_equal(d2t[ours[s].argmax(-1)], d2t[ref["draft_tokens"][s]]), (name, s)
    assert np.abs(_softmax(ours[0]).max(-1)).mean() > 0.2  # peaked distributions: the comparison is not vacuous


@pytest.mark.parametrize("name", sorted(HEADS))
def test_exported_with_its_taps_greedy_equal_plain(name, fixtures, tmp_path):
    import onnxruntime as ort
    import torch

    from speccompile.models.decoder import build_decoder, causal_mask
    from test_heads_runtime import PROMPTS, export_with, spec_vs_plain

    target, model, out = fixtures
    if len(PROMPTS) == 1:
        from test_heads_helpers import word_prompt_ids

        PROMPTS.extend([word_prompt_ids(1), word_prompt_ids(2)])
    m = export_with("eagle3", target, tmp_path / "art", ckpt=out / name, tree="chain-4")
    taps = HEADS[name][1]
    assert m.graphs["target"].extra["aux_layers"] == taps and m.drafter["head"]["aux_layer_ids"] == taps
    # the target graph's aux output is the taps the head asked for (id L: the final hidden state before the norm)
    sess = ort.InferenceSession(str(tmp_path / "art" / "target.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[1, 40, 41, 42, 43, 10]])
    feed = {"input_ids": ids, "position_ids": np.arange(6)[None], "attention_mask": causal_mask(6, 0).numpy()}
    feed.update({i.name: np.zeros((1, model.config.num_key_value_heads, 0, model.config.head_dim), np.float32)
                 for i in sess.get_inputs() if i.name.startswith("past")})
    aux = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))["aux_hidden_states"]
    dec = build_decoder(model.config, model.weights, "eagle3", tuple(taps))
    with torch.no_grad():
        ref = dec(torch.tensor(ids), torch.arange(6)[None], causal_mask(6, 0), *dec.empty_past())[-1]
    np.testing.assert_allclose(aux, ref.numpy(), atol=1e-4, rtol=1e-4)
    stats = spec_vs_plain(tmp_path / "art", "eagle3", {"chain": None, "dynamic": "dynamic-3-2-6"})
    assert all(s[0] > 0 for s in stats.values()), stats


@pytest.mark.parametrize("name", sorted(MTP_HEADS))
def test_mtp_module_drafts_as_the_library(fixtures, tmp_path, name):
    """The library's MTP module (a Qwen3 layer, `mtp_layers.0.*`): each teacher-forced step is a causal pass over
    the rows, fed the previous step's output; our graph gives the same distributions and tokens."""
    import onnxruntime as ort

    from speccompile.export.heads import export_head_graph
    from speccompile.models.head_loaders import load_head

    _, model, out = fixtures
    head = load_head("mtp", out / name, model.config, model.weights)
    assert (head.head_config.layout, head.head_config.layer.qk_norm) == ("mtp/speculators", MTP_HEADS[name] == "qwen3")
    export_head_graph(head, tmp_path / "mtp.onnx")
    session = ort.InferenceSession(str(tmp_path / "mtp.onnx"), providers=["CPUExecutionProvider"])
    ref = np.load(out / name / "oracle.npz")
    steps, rows = ref["logits"].shape[:2]
    hidden, ids = ref["features"][:rows], ref["input_ids"]
    kv = np.zeros((1, head.head_config.layer.num_key_value_heads, 0, head.head_config.layer.head_dim), np.float32)
    for s in range(steps):
        feed = {"input_ids": ids[s + 1: s + 1 + rows][None], "position_ids": np.arange(rows)[None],
                "attention_mask": np.tril(np.ones((rows, rows), bool))[None], "hidden_states": hidden[None],
                "past_key_values.0.key": kv, "past_key_values.0.value": kv}
        result = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
        ours = result["logits"][0]
        np.testing.assert_allclose(_softmax(ours), _softmax(ref["logits"][s]), atol=1e-4, rtol=0)
        assert np.array_equal(ours.argmax(-1), ref["logits"][s].argmax(-1)), s
        hidden = result["draft_hidden_states"][0]
    # and exported with the target, greedy speculative == plain
    from test_heads_runtime import export_with, spec_vs_plain

    target = fixtures[0]
    export_with("mtp", target, tmp_path / "art", ckpt=out / name, tree="chain-3")
    stats = spec_vs_plain(tmp_path / "art", "mtp", {"chain": None})
    assert stats["chain"][0] > 0, stats
