"""infinity: a tiered offload engine for PyTorch training in the ZeRO-Infinity style.

The public surface: ``infinity.initialize(model, config)`` (the engine), ``infinity.init(config)``
(build a model larger than memory), ``InfinityConfig`` / ``load_config``, the error types and
``LinkModel`` (a modeled link under the collectives: ``initialize(..., comm_link=...)``). The
package's tree shows its architecture; each subpackage's docstring says its one job:
``config`` (typed configuration, the DeepSpeed mapping), ``io`` (bytes between memory and files),
``tiers`` (the tiered store and its budgets), ``prefetch`` (trace-driven prefetch, knows no tiers),
``optim`` (Adam over flat shards, in memory and offloaded), ``zero`` (the engine, units, the
parameter manager, gradient reduction), ``pipeline`` (pipeline stages, each an engine),
``checkpoint`` (save, load, consolidate, weights),
``ledger`` (the memory ledger and pricing: pure arithmetic), ``cli`` and ``bench``.
"""

from infinity._modeled_link import LinkModel
from infinity.config import InfinityConfig, load_config
from infinity.errors import IllegalTransitionError, InfinityError, SwapIOError, TierCapacityError

__all__ = ["IllegalTransitionError", "InfinityConfig", "InfinityError", "LinkModel", "SwapIOError",
           "TierCapacityError", "init", "initialize", "load_config"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # initialize pulls in torch and the engine; loading it lazily keeps ``import infinity`` and
    # the CLI's start-up light.
    if name == "initialize":
        from infinity.zero import initialize

        return initialize
    if name == "init":
        from infinity.zero import init

        return init
    raise AttributeError(f"module 'infinity' has no attribute {name!r}")
