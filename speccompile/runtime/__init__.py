"""The torch-free runtime: open an artifact, draft, verify exactly. The public API is re-exported here."""

from ..draft_config import DraftConfig
from .stats import GenerationResult, GenerationStats
from .options import GenerationConfig, RunOptions
from .penalties import LogitPenalties
from .sampling import SamplingParams
from .session import Runner, TextStream

__all__ = ["DraftConfig", "GenerationConfig", "GenerationResult", "GenerationStats", "LogitPenalties", "RunOptions",
           "Runner", "SamplingParams", "TextStream"]
