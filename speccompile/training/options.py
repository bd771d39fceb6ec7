"""What a train-draft run does (`TrainOptions`): the head kind, the schedule and the data budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InputError

METHODS = ("eagle3", "eagle", "medusa", "dflash")


@dataclass
class TrainOptions:
    method: str = "eagle3"
    steps: int = 200
    seq_len: int = 256
    batch: int = 4
    lr: float = 1e-3
    warmup: int = 20
    unroll: int | None = None  # default: 3 for eagle3, 2 for eagle, 1 for medusa (dflash: unused)
    label_k: int = 8
    draft_vocab: int | None = None  # eagle3: default min(vocab, 8192)
    medusa_heads: int = 3
    block_size: int = 8  # dflash: block positions per drafting pass (block_size - 1 drafts)
    max_tokens: int = 200_000  # cap on training tokens read from --data
    save_every: int = 50
    resume: bool = False
    force: bool = False  # start over in an existing train-draft folder (its feature cache is reused)
    seed: int = 0
    cls_weight: float = 1.0
    reg_weight: float = 1.0
    threads: int | None = None
    extra: dict = field(default_factory=dict)

    def validate(self) -> "TrainOptions":
        if self.method not in METHODS:
            raise InputError(f"method must be one of {', '.join(METHODS)}, got {self.method}", "method")
        for name in ("steps", "seq_len", "batch", "label_k", "save_every", "max_tokens"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}", name)
        if self.seq_len < 4:
            raise InputError("seq_len must be >= 4", "seq_len")
        if self.method == "dflash" and not 2 <= self.block_size <= self.seq_len // 2:
            raise InputError(f"block_size must be between 2 and half the sequence length ({self.seq_len // 2}), got {self.block_size}",
                             "block_size")
        if self.unroll is None:
            self.unroll = {"eagle3": 3, "eagle": 2, "medusa": 1, "dflash": 1}[self.method]
        return self
