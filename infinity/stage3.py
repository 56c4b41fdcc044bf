"""ZeRO stage 3: the parameter manager and the engine entry (the design card's
``infinity.stage3``).

- :func:`initialize` ``(model, config) -> InfinityEngine``: the engine (stages 0-3; stage 3
  gathers each unit's parameters on demand and frees them after use), with its optimizer, the
  tiered store and the prefetcher; :func:`init` builds a model larger than memory under
  ``with init(config):``.
- :class:`ParameterManager` (``engine.manager``): the units of one model, their hooks, gathers
  (issued ahead, waited at use), releases and gradient reductions. A :class:`Unit` is one flat
  group set gathered and released together; :class:`UnitState` says where its bytes are
  (RELEASED, GATHERING, GATHERED) and :class:`UnitUse` what of the step still reads it, each
  changed through its own table of transitions.

The public face of :mod:`infinity.zero` for stage 3 (the code lives there: ``_param_manager.py``,
``_flat_group.py``, ``_unit_storage.py``, ``_engine.py``); ``infinity.initialize`` and
``infinity.init`` are the same functions.
"""

from infinity.zero import (InfinityEngine, ParameterManager, Unit, UnitState, UnitUse, init,
                           initialize)

__all__ = ["InfinityEngine", "ParameterManager", "Unit", "UnitState", "UnitUse", "init",
           "initialize"]
