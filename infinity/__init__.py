"""infinity: a tiered offload engine for PyTorch training in the ZeRO-Infinity style."""

from infinity._common import SwapIOError, TierCapacityError
from infinity.config import InfinityConfig, load_config

__all__ = ["InfinityConfig", "SwapIOError", "TierCapacityError", "init", "initialize",
           "load_config"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # initialize pulls in torch and the engine; loading it lazily keeps ``import infinity`` and
    # the CLI's start-up light.
    if name == "initialize":
        from infinity.engine import initialize

        return initialize
    if name == "init":
        from infinity.lazy import init

        return init
    raise AttributeError(f"module 'infinity' has no attribute {name!r}")
