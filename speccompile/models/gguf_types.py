"""What a GGUF file stores its layer weights in: the types and their bits (an INT4 build of a file stored above 4
bits runs a less accurate model than the file: engines/build.py says so)."""

from __future__ import annotations

import re
from pathlib import Path


def stored_weight_types(path: Path) -> dict[str, int]:
    """How many of a GGUF file's layer weights (the `blk.*` tensors of two or more dimensions) each stored type holds:
    a "Q4_K_M" file is mostly Q5_0 / Q6_K / Q8_0 (Gemma 3 270M's), which an INT4 build requantizes (`stored_bits`)."""
    import gguf

    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if tensor.name.startswith("blk.") and len(tensor.shape) >= 2:
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def stored_bits(type_name: str) -> int | None:
    """Bits a weight of a GGUF type name holds (F16: 16, Q6_K: 6, IQ4_XS: 4, MXFP4: 4; None: not known): the number
    after the type's kind, whole for floats and plain integers (F32, BF16, I8), its first digit for block types."""
    if type_name == "MXFP4":
        return 4
    match = _TYPE_BITS.match(type_name)
    if match is None:
        return None
    return int(match["bits"] if match["kind"] in ("F", "BF", "I") else match["bits"][0])


_TYPE_BITS = re.compile(r"(?P<kind>BF|F|IQ|TQ|Q|I)(?P<bits>\d+)")
