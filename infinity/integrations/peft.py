"""peft on the engine: a LoRA (or other adapter) model trains with only its adapters' optimizer
state; its adapter is saved in peft's format, and a base model's checkpoint loads into it.

    from peft import LoraConfig, get_peft_model
    from infinity.integrations.peft import load_base_weights, save_adapter

    with infinity.init(config):                    # the base is never whole in memory
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir))
        model = get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    engine = infinity.initialize(model)
    load_base_weights(engine, base_dir)            # the base model's safetensors, by byte range
    ...                                            # engine(...), engine.backward, engine.step
    save_adapter(engine, "out/adapter")            # adapter_config.json, adapter_model.safetensors

``PeftModel.from_pretrained(base_model, "out/adapter")`` then loads it into a plain model.
``get_peft_model`` belongs inside the ``infinity.init`` block (or a second one,
``with infinity.init(extend=model):``): outside, peft builds each adapter on the CPU and moves it
to its base layer's meta device, dropping its values ([Note: adding to a recorded model] in
infinity/zero/_lazy.py).

What the engine does with the frozen base ([Note: frozen parameters] in
infinity/ledger/_estimate.py): its flat groups get no gradient accumulator, no fp32 master and no
optimizer sub-group; with ``offload_param: nvme`` their shards are written once at set-up and only
read afterwards (each step reads the base from NVMe, and writes back only the adapters' shards).
Saving reads only the flat groups that hold the adapter (:func:`adapter_state_dict`), so it never
gathers the base.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_BASE_SEGMENTS = ("base_layer", "original_module")
"""Module names peft inserts above a wrapped module of the base model: a tuner layer's
``base_layer``, a ``ModulesToSaveWrapper``'s ``original_module``."""


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:
        raise ImportError("infinity.integrations.peft needs peft: pip install 'infinity[hf]' "
                          "(or pip install peft)") from e
    return peft


def _peft_model(engine: Any) -> Any:
    model = engine.module
    if not hasattr(model, "peft_config") or not hasattr(model, "get_base_model"):
        raise ValueError(f"expected an engine over a peft model (get_peft_model(...) before "
                         f"infinity.initialize), got one over {type(model).__name__}")
    return model


def adapter_keys(engine: Any, adapter_name: str = "default", *,
                 save_embedding_layers: bool | str = "auto") -> dict[str, str]:
    """peft's key in the saved adapter -> the model's ``state_dict`` key holding its value, for
    the entries ``get_peft_model_state_dict`` saves for ``adapter_name``. Reads no values."""
    get_state = _peft().get_peft_model_state_dict
    model = _peft_model(engine)
    if adapter_name not in model.peft_config:
        raise ValueError(f"adapter_name: {adapter_name!r} is not an adapter of this model; it has "
                         f"{sorted(model.peft_config)}")
    # The parameters themselves (keep_vars: a released unit's values are not in them) tell which
    # model key each entry peft picks comes from.
    state = model.state_dict(keep_vars=True)
    key_of: dict[int, str] = {}
    for key, value in state.items():
        key_of.setdefault(id(value), key)
    picked = get_state(model, state_dict=state, adapter_name=adapter_name,
                       save_embedding_layers=save_embedding_layers)
    out = {}
    for peft_key, value in picked.items():
        if id(value) not in key_of:
            raise ValueError(f"adapter entry {peft_key!r} is not a tensor of the model's "
                             f"state_dict (prompt-learning adapters compute theirs); only "
                             f"adapters made of parameters can be saved from the engine")
        out[peft_key] = key_of[id(value)]
    return out


def adapter_state_dict(engine: Any, adapter_name: str = "default", *,
                       save_embedding_layers: bool | str = "auto") -> dict[str, torch.Tensor]:
    """The adapter as ``get_peft_model_state_dict(model)`` returns it from a plain model (peft's
    keys), with the engine's fp32 values (the masters of trained parameters). Only the flat groups
    holding the adapter are gathered. A collective: call it on every rank."""
    keys = adapter_keys(engine, adapter_name, save_embedding_layers=save_embedding_layers)
    values = engine.full_state_dict(keys=sorted(set(keys.values())))
    return {peft_key: values[key] for peft_key, key in keys.items()}


def save_adapter(engine: Any, save_directory: str | os.PathLike[str], *,
                 selected_adapters: list[str] | None = None,
                 save_embedding_layers: bool | str = "auto", safe_serialization: bool = True,
                 **kwargs: Any) -> None:
    """``model.save_pretrained(save_directory)`` of the engine's peft model (adapter config and
    weights in peft's format, ``PeftModel.from_pretrained`` loads them), with the engine's fp32
    adapter values. A collective: call it on every rank; rank 0 writes. ``kwargs`` go to
    ``PeftModel.save_pretrained``."""
    model = _peft_model(engine)
    names = list(model.peft_config) if selected_adapters is None else list(selected_adapters)
    keys: set[str] = set()
    for name in names:
        keys.update(adapter_keys(engine, name, save_embedding_layers=save_embedding_layers).values())
    state = engine.full_state_dict(keys=sorted(keys))
    model.save_pretrained(os.fspath(save_directory), state_dict=state, selected_adapters=names,
                          save_embedding_layers=save_embedding_layers,
                          safe_serialization=safe_serialization,
                          is_main_process=engine.collectives.rank == 0, **kwargs)


def base_key_map(engine: Any) -> tuple[dict[str, str], set[str]]:
    """(model key -> its name in the base model's checkpoint, the adapters' own keys).

    peft nests the base model under the wrapper (``base_model.model.``) and each wrapped module
    under ``base_layer`` (``original_module`` for ``modules_to_save``, whose trainable copy under
    ``modules_to_save.<adapter>`` starts from the same base values, as when peft copies a loaded
    module). Everything else on a tuner layer is the adapter's own (absent from a base
    checkpoint)."""
    peft = _peft()
    model = _peft_model(engine)
    base = model.get_base_model()
    prefix = next(f"{n}." for n, m in model.named_modules() if m is base)
    adapters = set(model.peft_config)
    tuner_prefixes = [f"{n}." for n, m in model.named_modules()
                      if isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer)]
    key_map: dict[str, str] = {}
    own: set[str] = set()
    for key in model.state_dict(keep_vars=True):
        if not key.startswith(prefix):
            own.add(key)  # the wrapper's own (prompt encoders)
            continue
        tuner = next((p for p in tuner_prefixes if key.startswith(p)), None)
        if tuner is not None and not key.startswith(f"{tuner}base_layer."):
            own.add(key)
        parts = key[len(prefix):].split(".")
        kept, i = [], 0
        while i < len(parts):
            if parts[i] in _BASE_SEGMENTS:
                i += 1
            elif parts[i] == "modules_to_save" and i + 1 < len(parts) and parts[i + 1] in adapters:
                i += 2
            else:
                kept.append(parts[i])
                i += 1
        key_map[key] = ".".join(kept)
    return key_map, own


def load_base_weights(engine: Any, path: str | os.PathLike[str], *, strict: bool = True
                      ) -> dict[str, list[str]]:
    """Load a base model's checkpoint (safetensors file, directory, HF sharded index, keyed like
    the unwrapped model) into the engine's peft model, straight into the shards
    (:meth:`InfinityEngine.load_weights`). ``strict``: every base parameter must be in the file
    and nothing else; the adapters' own parameters keep their values (listed as missing). A
    collective: call it on every rank."""
    key_map, own = base_key_map(engine)
    return engine.load_weights(os.fspath(path), strict=strict,
                               key_map={k: v for k, v in key_map.items() if k not in own},
                               optional_keys=own)


__all__ = ["adapter_keys", "adapter_state_dict", "base_key_map", "load_base_weights",
           "save_adapter"]
