"""The streaming Q/DQ pass: each unit (engines/units.py) fitted by the methods as soon as its activations are
calibrated, its weights quantized and written, then forgotten; the graph rewritten around the stored weights at the
end. Memory holds the graph's structure and one unit's weights.

The numbers are those of the whole-model pass (engines/quantize.py's `quantize_model` after `apply_methods`): a
unit holds every weight its activations' methods read or change, the methods run on it with the same statistics in
the same order, and each weight is stored by the same `store_weight` / `store_table`. With `hold` (the passes that
need the whole model after the methods: QAD, the --min-top1 search) nothing is stored here: the weights stay
loaded and `methods` keeps every grid and clipping ratio for them.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .calibrate import ActivationStats
from .initializers import ModelInitializers
from .methods import MethodOptions, MethodReport, apply_methods
from .qdq_targets import EmbeddingTable, QuantOptions
from .quantize import QuantReport, graph_names, plan_qdq, rewrite_qdq
from .source_grid import find_source_grid
from .units import Unit
from .weight_codes import StoredWeight, store_table, store_weight
from .working_graph import ExternalSink, WorkingGraph

Progress = Callable[[str], None]


class UnitPass:
    """Runs units on `work` (`qopts`: the build's options; `method_qopts`: the same with the source-grid weights
    excluded, what the methods fit); `grid_tables`: the weights on a source grid -> whether each is a table."""

    def __init__(self, work: WorkingGraph, qopts: QuantOptions, method_qopts: QuantOptions, methods: MethodOptions,
                 grid_tables: dict[str, bool], sink: ExternalSink, hold: bool, measure_errors: bool, progress: Progress):
        self.work, self.qopts, self.method_qopts, self.methods = work, qopts, method_qopts, methods
        self.grid_tables, self.sink, self.hold, self.measure_errors = grid_tables, sink, hold, measure_errors
        self.progress = progress
        self.report = MethodReport()
        self.stored: dict[str, StoredWeight] = {}
        self.taken = graph_names(work.model)

    @property
    def act_amax(self) -> dict[str, float] | None:
        return self.report.act_amax if self.qopts.quantizes_activations else None

    def run(self, unit: Unit, stats: dict[str, ActivationStats]) -> None:
        """Fit `unit` on `stats` (its activations' statistics); unless holding, store its weights and forget them."""
        if stats:
            values = ModelInitializers(self.work.model) if self.hold else self.work
            self.report.merge(apply_methods(self.work.model, self.method_qopts, stats, self.methods, self.progress,
                                            self.measure_errors, values))
        if not self.hold:
            self._store(unit)

    def _store(self, unit: Unit) -> None:
        model = self.work.model
        plan = plan_qdq(model, self.qopts, self.act_amax, QuantReport(self.qopts.scheme), check_heads=False)
        target_reads: dict[str, int] = {}
        for index in plan.targets:
            name = model.graph.node[index].input[1]
            target_reads[name] = target_reads.get(name, 0) + 1
        tables = {t.name: t for t in plan.tables}
        reads: dict[str, int] = {}
        for node in model.graph.node:
            for name in node.input:
                reads[name] = reads.get(name, 0) + 1
        replaced = set()
        for name in unit.weights:
            if name in tables:
                self.stored[name] = self._table(tables[name])
                replaced.add(name)
            elif name in target_reads:
                self.stored[name] = self._weight(name)
                if target_reads[name] == reads.get(name, 0):  # every reader will read the quantized weight
                    replaced.add(name)
        self.report.release(set(unit.weights))
        self.work.drop(replaced)
        self.work.store([name for name in unit.weights if name not in replaced])

    def _grid(self, name: str):
        grid = self.report.weight_grid.get(name)
        if grid is None and name in self.grid_tables:
            grid = find_source_grid(self.work.value(name), self.grid_tables[name], self.qopts.scheme)
        return grid

    def _weight(self, name: str) -> StoredWeight:
        grid = self._grid(name)
        w = grid.weight if grid is not None and grid.weight is not None else self.work.value(name).astype(np.float32)
        elem = self.work.initializers()[name].data_type
        return store_weight(name, w, elem, self.qopts, self.sink, self.taken, self.report.weight_clip.get(name), grid)

    def _table(self, table: EmbeddingTable) -> StoredWeight:
        grid = self._grid(table.name)
        value = grid.weight.T if grid is not None and grid.weight is not None else self.work.value(table.name).astype(np.float32)
        elem = self.work.initializers()[table.name].data_type
        return store_table(table.name, value, elem, self.qopts, self.sink, self.taken, self.report.weight_clip.get(table.name), grid)

    def rewrite(self) -> QuantReport:
        """The Q/DQ graph around the stored weights (every unit has run)."""
        model = self.work.model
        pending = dict(self.stored)

        def weight(name: str) -> StoredWeight:
            return pending.pop(name)

        def table(t: EmbeddingTable) -> StoredWeight:
            return pending.pop(t.name)

        report = rewrite_qdq(model, self.qopts, self.act_amax, weight, table, self.taken | graph_names(model), self.sink)
        if pending:
            raise AssertionError(f"stored but not placed by the Q/DQ pass: {', '.join(sorted(pending))}")
        return report

