"""The backend factory opens every graph kind: target, EAGLE/MTP heads (feature inputs) and Medusa heads."""

from __future__ import annotations

import numpy as np
import pytest

from test_heads_helpers import shared_target, write_checkpoint


@pytest.fixture(scope="module")
def head_artifacts(tmp_path_factory):
    import torch

    from speccompile.export.pipeline import ExportOptions, export_artifact

    torch.set_num_threads(1)
    target = shared_target(tmp_path_factory)
    root = tmp_path_factory.mktemp("backends")
    out = {}
    for kind in ("eagle", "medusa"):
        ckpt = write_checkpoint(root / f"{kind}_ckpt", kind)
        export_artifact(str(target), root / kind, ExportOptions(drafter=f"{kind}:{ckpt}", max_context=128, draft_cpu_weights="fp32"))
        out[kind] = root / kind
    return out


def test_eagle_head_opens_through_the_factory(head_artifacts):
    from speccompile.runtime.artifact import open_artifact
    from speccompile.runtime.backends.ort import OrtSession

    artifact = open_artifact(head_artifacts["eagle"], threads=1)
    session = artifact.session("eagle")
    assert isinstance(session, OrtSession) and list(session.feature_dtypes) == ["hidden_states"]
    width = int(next(t for t in session.spec.inputs if t.name == "hidden_states").shape[-1])
    cache = session.new_cache()
    ids, pos = np.array([3, 4, 5]), np.arange(3)
    mask = cache.attention_mask(np.tril(np.ones((3, 3), dtype=bool)))
    with pytest.raises(ValueError, match="hidden_states"):
        session.run(ids, pos, mask, cache)
    hidden = np.random.default_rng(0).standard_normal((3, width)).astype(np.float32)
    out = session.run(ids, pos, mask, cache, hidden_states=hidden)
    assert out.logits.shape[0] == 3 and out.hidden is not None and out.hidden.shape[0] == 3
    assert len(out.presents) == len(session.present_names) and cache.physical_len == 0  # the cache object is untouched
    # the head row for position 2 does not depend on later rows: run row by row through the cache, same logits
    step_cache = session.new_cache()
    rows = []
    for t in range(3):
        step = session.run(ids[t:t + 1], pos[t:t + 1], step_cache.attention_mask(np.ones((1, 1), dtype=bool)), step_cache,
                           hidden_states=hidden[t:t + 1])
        step_cache.append(step.presents, [0], 1)
        rows.append(step.logits[0])
    np.testing.assert_allclose(np.stack(rows), out.logits, rtol=1e-4, atol=1e-4)


def test_medusa_heads_open_as_feature_session(head_artifacts):
    from speccompile.manifest import read_manifest
    from speccompile.runtime.artifact import open_artifact
    from speccompile.runtime.backends.ort import OrtFeatureSession

    artifact = open_artifact(head_artifacts["medusa"], threads=1)
    session = artifact.session("medusa")
    assert isinstance(session, OrtFeatureSession)
    width = int(session.spec.inputs[0].shape[-1])
    logits = session.run(np.zeros((2, width), np.float32))
    heads = read_manifest(head_artifacts["medusa"]).drafter["head"]["medusa_num_heads"]
    assert logits.shape[:2] == (2, heads) and logits.dtype == np.float32


def test_heads_on_tensorrt_need_an_engine(head_artifacts):
    from speccompile.errors import ArtifactError
    from speccompile.manifest import read_manifest
    from speccompile.runtime.backends.factory import open_session

    for kind in ("eagle", "medusa"):
        manifest = read_manifest(head_artifacts[kind])
        with pytest.raises(ArtifactError, match="no TensorRT engine"):
            open_session(head_artifacts[kind], manifest.graph(kind), "tensorrt", manifest=manifest)
