"""Trace-driven prefetch: recorded unit traces, a pure planner, and a small executor around it.

Knows no tiers, no store and no units' contents: it plans over the rungs
``Level.NVME -> HOST -> DEVICE -> GATHERED`` and issues hops through callbacks; the parameter
manager's prefetcher (:mod:`infinity.zero._prefetcher`) turns those into store fetches and gathers.

- :mod:`._trace`: ``Level``, ``Trace``, ``TraceEntry``, ``TraceStore``, ``TraceFollower``: traces
  per phase and a follower that tolerates divergence ([Note: divergence never raises]).
- :mod:`._planner`: ``FetchQuery`` in, ``FetchAction`` list out (``plan_fetches``); pure.
- :mod:`._executor`: ``PrefetchExecutor`` (in-flight byte bounds, bandwidth estimates, stats),
  configured by ``PrefetchConfig``, units registered as ``UnitSizes``.

Module DAG inside the package: ``_trace`` <- ``_planner`` <- ``_executor``.
"""

from infinity.prefetch._config import PrefetchConfig, UnitSizes
from infinity.prefetch._executor import PrefetchExecutor
from infinity.prefetch._planner import (HOPS, Bandwidths, FetchAction, FetchQuery, Hop, hop_chain,
                                        plan_fetches)
from infinity.prefetch._trace import (Follow, Level, Trace, TraceEntry, TraceFollower,
                                      TraceRecorder, TraceStore, as_level)

__all__ = ["HOPS", "Bandwidths", "FetchAction", "FetchQuery", "Follow", "Hop", "Level",
           "PrefetchConfig", "PrefetchExecutor", "Trace", "TraceEntry", "TraceFollower",
           "TraceRecorder", "TraceStore", "UnitSizes", "as_level", "hop_chain", "plan_fetches"]
