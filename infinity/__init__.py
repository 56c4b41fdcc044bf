"""infinity: a tiered offload engine for PyTorch training in the ZeRO-Infinity style."""

from infinity._common import SwapIOError, TierCapacityError
from infinity.config import InfinityConfig, load_config

__all__ = ["InfinityConfig", "SwapIOError", "TierCapacityError", "load_config"]
__version__ = "0.1.0"
