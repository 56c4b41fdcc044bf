"""``deepspeed.zero`` for the drop-in: :class:`Init` and :class:`GatheredParameters`."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch

from infinity.checkpoint import write_param_values
from infinity.zero import engine_of, extend_recording, init


def Init(module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,
         remote_device: Any = None, pin_memory: bool = False, config_dict_or_path: Any = None,
         config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None,
         **_ignored: Any) -> contextlib.AbstractContextManager:
    """``with deepspeed.zero.Init(config_dict_or_path=...):`` builds the model without holding
    its weights: :func:`infinity.init` (where they live is the config's ``offload_param``, so
    ``remote_device`` and ``pin_memory`` say nothing more). ``enabled=False``: a plain block."""
    if module is not None:
        raise ValueError("deepspeed.zero.Init(module=...) (converting a built model) is not "
                         "supported: build the model inside `with deepspeed.zero.Init(...)`, or "
                         "pass the built model to deepspeed.initialize as it is")
    if not enabled:
        return contextlib.nullcontext()
    return init(config_dict_or_path if config_dict_or_path is not None else config)


class GatheredParameters:
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=None):`` inside, each of
    ``params`` (one parameter or several) is whole on every rank; with ``modifier_rank``, that
    rank's changes are written back on exit to the parameters' shards wherever they live (the
    fp32 optimizer masters, the parameter shards, NVMe), on every rank. A collective: every rank
    enters with the same parameters.

    On a model built under ``deepspeed.zero.Init`` and not initialised yet, the block is recorded
    into the model's construction ([Note: adding to a recorded model] in
    infinity/zero/_lazy.py): edits, new modules and resized embeddings replay at ``initialize``,
    as eager code would have run them (each rank replays its own; the engine starts from rank
    0's values). Parameters no engine manages and no recording owns are left as they are.

    After ``initialize`` the parameters' shapes are fixed (their flat buffers are laid out), so
    a changed shape is an error naming the parameter; a parameter of an engine is written back
    only where its values changed, so the others' fp32 masters keep their precision (one that
    changed takes its compute-dtype values)."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if p is not None] if enabled else []
        self.modifier_rank = modifier_rank
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> "GatheredParameters":
        self._stack = contextlib.ExitStack()
        engines = {id(e): e for e in (engine_of(p) for p in self.params) if e is not None}
        if len(engines) > 1:
            raise ValueError("GatheredParameters: the parameters belong to more than one engine; "
                             "gather each engine's apart")
        if engines:
            engine = next(iter(engines.values()))
            self._stack.enter_context(_gathered_for_edit(engine, self.params, self.modifier_rank))
        else:
            self._stack.enter_context(extend_recording(self.params))
        return self

    def __exit__(self, *exc: Any) -> bool:
        stack, self._stack = self._stack, None
        return bool(stack.__exit__(*exc)) if stack is not None else False


@contextlib.contextmanager
def _gathered_for_edit(engine: Any, params: Iterable[torch.Tensor],
                       modifier_rank: int | None) -> Iterator[None]:
    engine.finish_step()  # a deferred step and after-step gathers land first
    if not engine.between_steps:
        raise ValueError(f"GatheredParameters at micro-step {engine.micro_steps}, inside a "
                         f"gradient accumulation window: use it between steps")
    manager = engine.manager
    with manager.gathered(params) as managed:
        before = [p.detach().clone() for p in managed] if modifier_rank is not None else []
        shapes = [tuple(p.shape) for p in managed]
        yield
        if modifier_rank is None:
            return
        changed: dict[torch.Tensor, torch.Tensor] = {}
        for p, old, shape in zip(managed, before, shapes):
            if tuple(p.shape) != shape:
                raise ValueError(f"GatheredParameters: a parameter's shape changed from "
                                 f"{list(shape)} to {list(p.shape)}; after initialize shapes "
                                 f"are fixed (resize before it, under deepspeed.zero.Init)")
            value = p.detach().clone()
            engine.collectives.broadcast(value, src=modifier_rank,
                                         context="GatheredParameters (modifier_rank)")
            flag = torch.tensor([int(not torch.equal(value, old))], device=value.device)
            engine.collectives.broadcast(flag, src=modifier_rank,
                                         context="GatheredParameters (modifier_rank)")
            if int(flag.item()):
                changed[p] = value
            elif not torch.equal(p.detach(), old):  # this rank's own edit: not the modifier's
                with torch.no_grad():
                    p.copy_(old)  # (an always-gathered unit would keep it; a released one not)
    if changed:  # the units are given back first: their next gather reads the new shards
        write_param_values(engine, changed)
