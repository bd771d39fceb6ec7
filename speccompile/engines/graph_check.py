"""The checks of a written graph, in memory bounded by one segment: onnx's checker (it reads the graph file and the
sizes of its external data, not the data), and ONNX Runtime loading and running it on a few tokens one segment at a
time (engines/segments.py), so a model larger than memory is checked as well as a small one."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import onnx

from ..errors import SpecCompileError
from ..manifest import GraphSpec
from ..weights_file import load_graph
from .calibrate import prefill_feeds
from .segments import SEGMENT_PARAMETERS, SegmentRunner

CHECK_TOKENS = (1, 2, 3, 4)


def check_graph(directory: Path, spec: GraphSpec, run_ort: bool, ids: Sequence[int] = CHECK_TOKENS,
                threads: int | None = None, workdir: Path | None = None, parameters: int = SEGMENT_PARAMETERS) -> None:
    """onnx checker on `spec.file` of `directory`; with `run_ort`, a prefill pass of `ids` through ONNX Runtime CPU,
    which must give finite logits. A failure is a SpecCompileError naming the file and the first line of the cause."""
    path = Path(directory) / spec.file
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # noqa: BLE001
        raise SpecCompileError(f"{path.name}: onnx checker failed after quantization: {str(exc).splitlines()[0]}") from exc
    if not run_ort:
        return
    logits: list[np.ndarray] = []
    try:
        runner = SegmentRunner(directory, load_graph(path), threads, workdir)
        runner.run([prefill_feeds(spec, list(ids))], ["logits"], lambda _s, _n, value: logits.append(value), parameters)
    except Exception as exc:  # noqa: BLE001
        raise SpecCompileError(f"{path.name}: ONNX Runtime cannot run the quantized graph: {str(exc).splitlines()[0]}") from exc
    if not logits or not np.isfinite(logits[0]).all():
        raise SpecCompileError(f"{path.name}: ONNX Runtime ran the quantized graph but its logits are not finite")
