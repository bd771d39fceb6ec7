"""weights_file: tensors streamed to an external data file, checksummed on the way, read back as memory maps."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from speccompile.manifest import sha256_of
from speccompile.weights_file import ALIGN_LARGE, WeightsWriter, load_graph, read_tensor


def _graph_with(tmp_path, writer_items):
    with WeightsWriter(tmp_path / "m.onnx.data") as writer:
        tensors = [writer.add(name, array) for name, array in writer_items]
        packed = writer.add_bytes("packed", bytes([0x21, 0x43]), TensorProto.UINT4, [4])
    return writer, tensors + [packed]


def test_written_file_checksum_alignment_and_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((300, 500)).astype(np.float32)
    items = [("small", rng.standard_normal(7).astype(ml_dtypes.bfloat16)), ("weight", weight), ("scalar", np.float32(3.5))]
    writer, tensors = _graph_with(tmp_path, items)

    assert writer.sha256 == sha256_of(tmp_path / "m.onnx.data")
    assert writer.stored("weight").offset % ALIGN_LARGE == 0  # large tensors can be mapped by ONNX Runtime
    assert tensors[0].data_type == TensorProto.BFLOAT16

    node = helper.make_node("MatMul", ["x", "weight"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 300])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 500])], tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, tmp_path / "m.onnx")
    onnx.checker.check_model(str(tmp_path / "m.onnx"), full_check=True)
    x = rng.standard_normal((1, 300)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ weight, rtol=1e-5, atol=1e-5)

    loaded = {t.name: t for t in load_graph(tmp_path / "m.onnx").graph.initializer}
    read = read_tensor(loaded["weight"], tmp_path)
    assert isinstance(read, np.memmap) and np.array_equal(read, weight)
    assert read_tensor(loaded["small"], tmp_path).dtype == ml_dtypes.bfloat16
    assert read_tensor(loaded["scalar"], tmp_path).shape == () and float(read_tensor(loaded["scalar"], tmp_path)) == 3.5
    assert bytes(read_tensor(loaded["packed"], tmp_path)) == bytes([0x21, 0x43])  # packed 4-bit: raw bytes


def test_a_name_is_written_once(tmp_path):
    with WeightsWriter(tmp_path / "w.data") as writer:
        writer.add("a", np.zeros(3, np.float32))
        try:
            writer.add("a", np.ones(3, np.float32))
        except ValueError as exc:
            assert "written twice" in str(exc)
        else:
            raise AssertionError("a second tensor under the same name was accepted")


def test_pieces_and_arrays_from_a_writer_thread_land_in_order_with_their_checksum(tmp_path):
    """A threaded writer fills pooled buffers (Piece) and takes arrays, more of them than its pool holds: the file
    has every byte in order, its sha256 is the file's, and a wrong total length is refused."""
    from speccompile.weights_file import Piece

    rng = np.random.default_rng(1)
    blocks = [rng.standard_normal((64, 100)).astype(np.float32) for _ in range(3 * WeightsWriter.QUEUED)]

    def piece(block):
        return Piece(block.nbytes, lambda buffer: np.copyto(buffer.view(np.float32).reshape(block.shape), block))

    with WeightsWriter(tmp_path / "w.data", threaded=True) as writer:
        chunks = [piece(b) if i % 2 else b for i, b in enumerate(blocks)]
        tensor = writer.add_chunks("w", TensorProto.FLOAT, [64 * len(blocks), 100], chunks, sum(b.nbytes for b in blocks))
        try:
            writer.add_chunks("short", TensorProto.FLOAT, [2], [np.zeros(1, np.float32)], 8)
        except ValueError as exc:
            assert "expected 8" in str(exc)
        else:
            raise AssertionError("a tensor shorter than its length was accepted")
    assert writer.sha256 == sha256_of(tmp_path / "w.data")
    assert np.array_equal(read_tensor(tensor, tmp_path), np.concatenate(blocks))
