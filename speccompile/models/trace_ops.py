"""Torch ops with a fixed ONNX form for the traced graphs (the torch reference decoders and the drafter heads)."""

from __future__ import annotations

import torch


class _StaticReshape(torch.autograd.Function):
    """Reshape whose ONNX form is one Reshape with a constant target (0 = keep that input dim).

    torch's exporter would otherwise compute every dynamic target shape at run time with
    Shape/Gather/Unsqueeze/Concat nodes: about 700 tiny nodes in a 30-layer model, several
    milliseconds per decode step in ONNX Runtime.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: tuple[int, ...]) -> torch.Tensor:  # noqa: D102
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]  # exactly one -1 (exporter needs it)
        return x.reshape(shape)

    @staticmethod
    def symbolic(g, x, target):  # noqa: D102
        const = g.op("Constant", value_t=torch.tensor(list(target), dtype=torch.int64))
        return g.op("Reshape", x, const)


def static_reshape(x: torch.Tensor, *target: int) -> torch.Tensor:
    """Reshape to `target`, where 0 keeps the input's dim and -1 is inferred (ONNX Reshape semantics)."""
    return _StaticReshape.apply(x, tuple(target))


def _const(g, value: int):
    """A one-element int64 Constant node (a Slice bound or axis) in the ONNX graph `g` a symbolic writes."""
    return g.op("Constant", value_t=torch.tensor([value], dtype=torch.int64))


class _DropLastRow(torch.autograd.Function):
    """x[:, :, :-1] whose ONNX form is one Slice with constant bounds (torch's exporter folded `-1` into a bound
    from a wrongly inferred length in the traced MTP module's latent attention)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x[:, :, :-1]

    @staticmethod
    def symbolic(g, x):  # noqa: D102
        return g.op("Slice", x, _const(g, 0), _const(g, -1), _const(g, 2))


def drop_last_row(x: torch.Tensor) -> torch.Tensor:
    """x without its last entry along axis 2 (the row `with_last_row` appended)."""
    return _DropLastRow.apply(x)


class _WithLastRow(torch.autograd.Function):
    """cat(x, x[:, :, -1:]) on axis 2, whose ONNX form is a Slice with constant bounds and a Concat (as
    `_DropLastRow`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return torch.cat((x, x[:, :, -1:]), dim=2)

    @staticmethod
    def symbolic(g, x):  # noqa: D102
        return g.op("Concat", x, g.op("Slice", x, _const(g, -1), _const(g, 2 ** 62), _const(g, 2)), axis_i=2)


def with_last_row(x: torch.Tensor) -> torch.Tensor:
    """x [b, h, rows, n] with a copy of its last row appended on axis 2."""
    return _WithLastRow.apply(x)
