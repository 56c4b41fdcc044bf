"""``with infinity.init(config): model = build()``: build a model without holding its weights.

Inside the block, tensors that construction creates without an explicit device land on the meta
device (shape and dtype, no bytes), and every operation that creates or writes a meta tensor is
recorded. ``infinity.initialize(model, config)`` then materialises the model unit by unit: each
parameter's values are computed on the CPU from the recording, copied into the unit's flat buffer
and sharded at once (see ``ParameterManager._build_group``), so a rank's peak host memory stays
near one unit plus its shards instead of the whole model.

[Note: lazy values equal eager values]
Construction calls the same init code as eager construction (``reset_parameters``,
``nn.init.*``, a model's ``_init_weights``); only the tensors are meta. Two things make the values
come out identical to building eagerly on the CPU:

* The RNG stream. While recording, every random operation on a meta tensor is also run once on a
  throw-away CPU tensor of the same geometry, so the generator advances exactly as eager
  construction advances it (random operations on real tensors in between draw the same numbers as
  eagerly, and the generator state after the block is eager's). The state before each random
  operation is kept (5 KiB each) and restored when the operation is replayed.
* The program. A tensor's value is the result of the operations that created and wrote its
  storage, and, transitively, of those that wrote the storages they read, each as of its position
  in the recorded order. ``Recording.value`` (infinity/zero/_recording.py) replays exactly that
  slice, in recorded order, on the CPU: a parameter initialised twice (in ``__init__`` and again
  by ``_init_weights``) replays only the second when it overwrote the whole storage unread
  ([Note: a whole overwrite ends a storage's history] in infinity/zero/_recording.py), both when
  it wrote a part; a parameter computed from another (``torch.randn(n) * 0.02``) replays its
  source first.

Replaying costs at most one more eager initialisation in compute (less where construction drew
a tensor's values twice); memory is one parameter (plus the tensors its slice reads) at a time.
Tensors are matched by storage, so views, tied parameters
(one object in two modules) and parameters that alias one buffer all resolve. Multi-rank: every
rank records and replays its own; the engine broadcasts rank 0's unit values, as it does for an
eagerly built model.

Not covered (each raises a clear error instead of giving different values): writing a meta
tensor's values into a real tensor during construction (``real.copy_(meta)``), reading a meta
value as a Python number (``.item()``), and initialising a recorded model any way other than
through ``infinity.initialize``. Modules added to a recorded model after its block closed and
moved to its meta device (peft's adapters, ``get_peft_model`` and ``PeftModel.from_pretrained``)
keep the values they had ([Note: modules moved onto a recorded model]); other code that adds
tensors after the block runs in a second block, ``with infinity.init(extend=model):``
([Note: adding to a recorded model]).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode

from infinity.config import load_config
from infinity.zero._recording import _CPU, _META, LazyInitError, Recording, _storage_key

logger = logging.getLogger(__name__)

# Constructors that carry their values (``torch.tensor([1., 2.])``) stay real: on the meta device
# the data would be lost.
_VALUE_CONSTRUCTORS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})


class _MetaByDefault(TorchFunctionMode):
    """Tensor constructors without an explicit device create meta tensors (what
    ``with torch.device('meta')`` does), except those that carry their values."""

    _constructors = _device_constructors() - _VALUE_CONSTRUCTORS

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._constructors and kwargs.get("device") is None:
            kwargs["device"] = _META
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.recording.record(func, args, kwargs or {})


# torch.nn.init functions that return early on meta tensors (and do not dispatch to modes), by
# the name their callers look up: ``trunc_normal_`` calls the module global
# ``_no_grad_trunc_normal_``, so patching that covers every way of calling it.
_META_SKIPPING_INIT = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")


@contextlib.contextmanager
def _record_meta_skipping_init(recording: Recording) -> Iterator[None]:
    originals = {name: getattr(nn.init, name) for name in _META_SKIPPING_INIT}

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(tensor, *args, **kwargs):
            if isinstance(tensor, torch.Tensor) and tensor.device == _META:
                return recording.record_call(original, (tensor, *args), kwargs)
            return original(tensor, *args, **kwargs)
        return recorded

    for name, original in originals.items():
        setattr(nn.init, name, wrap(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


_TRIM_EVERY_BYTES = 16 * 2**20
"""Materialising: hand freed heap memory back to the OS after about this many replayed bytes."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere).

    [Note: heap fragmentation while materialising]
    Materialising allocates a parameter-sized tensor per parameter, frees it, and keeps small
    allocations (the engine's bookkeeping) in between. glibc serves the large blocks from the heap
    once its dynamic mmap threshold has grown, and the small ones split the freed blocks, so the
    next parameter needs fresh heap: RSS grows by about the model's size, the very thing lazy
    construction avoids (measured: 48 x 4 MiB units, +380 MiB peak without trimming, +100 MiB
    with). ``malloc_trim(0)`` returns the free pages inside the heap, not only those at its top.
    """
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_LIVE: list[Recording] = []
"""Recordings whose models are not yet materialised (metadata only: meta tensors have no bytes)."""

_MOVED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
"""Storage key of a meta tensor a module moved onto the meta device while a recording lived ->
(that meta tensor, kept so that its key is never reused; the CPU value it had, in its dtype):
[Note: modules moved onto a recorded model]."""


def _capture_moves_to_meta() -> None:
    """[Note: modules moved onto a recorded model]
    Recipes add to a model after building it: ``model = get_peft_model(model, LoraConfig(...))``
    builds each LoRA adapter on the CPU, initialises it (``reset_lora_parameters``: random A, zero
    B) and moves it to its base layer's device and dtype (``.to(device, dtype=...)``). For a model
    built under ``infinity.init`` that device is meta, and the move drops the values. DeepSpeed's
    engine partitions parameters added after ``zero.Init`` when it starts, so these lines run
    unchanged there; here they do too: while a recording lives (a model built under
    ``infinity.init`` and not yet initialised), ``nn.Module.to`` onto the meta device keeps what
    each moved parameter and buffer held (cast to its new dtype, as the move would have cast it),
    and a ``load_state_dict`` into such a module afterwards (``PeftModel.from_pretrained`` loads a
    saved adapter that way) replaces the kept value. ``infinity.initialize`` takes a kept value
    as the tensor's, bitwise what eager peft gives. The wrapper costs one check when no recording
    lives or the move is not onto meta; the kept values are the moved modules' (adapters: small).
    A tensor moved onto meta any other way (``Tensor.to`` into a ``ParameterDict``) is not seen:
    ``initialize`` names it and the ``extend`` block that records it."""
    original = nn.Module.to
    if getattr(original, "_infinity_keeps_moved_values", False):
        return

    @functools.wraps(original)
    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if not _LIVE:
            return original(self, *args, **kwargs)
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is None or device.type != "meta":
            return original(self, *args, **kwargs)
        # .data: an alias of the values that outlives the move (a Parameter's data is swapped).
        before = {name: t.data for name, t in _named_tensors(self) if t.device != _META}
        out = original(self, *args, **kwargs)
        moved = False
        for name, t in _named_tensors(self):
            old = before.get(name)
            if old is not None and t.device == _META:
                _MOVED[_storage_key(t)] = (t, old.to(t.dtype))
                moved = True
        if moved:
            for module in self.modules():
                if not getattr(module, "_infinity_loads_moved", False):
                    module._register_load_state_dict_pre_hook(_load_into_moved, with_module=True)
                    module._infinity_loads_moved = True
        return out

    to._infinity_keeps_moved_values = True
    nn.Module.to = to


def _load_into_moved(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                     *args: Any) -> None:
    """``load_state_dict`` into a module moved onto a recorded model's meta device: the loaded
    values replace the kept ones (torch's copy into a meta tensor is a no-op)."""
    for name, t in list(module._parameters.items()) + list(module._buffers.items()):
        value = state_dict.get(prefix + name)
        if t is None or value is None or t.device != _META:
            continue
        key = _storage_key(t)
        if key in _MOVED and isinstance(value, torch.Tensor) and value.shape == t.shape:
            _MOVED[key] = (t, value.detach().to(device=_CPU, dtype=t.dtype, copy=True))
            # Kept: torch then copies meta into meta, without its "copy is a no-op" warning.
            state_dict[prefix + name] = value.detach().to(_META)


@contextlib.contextmanager
def init(config: Any = None, *, extend: nn.Module | None = None) -> Iterator[Recording]:
    """Build a model inside this block to materialise it later, unit by unit, straight into its
    shards (``infinity.initialize(model)``; ``config`` is validated now and used there when
    ``initialize`` is given none). See the module docstring.

    ``extend``: a model built under an earlier block and not yet initialised. This block goes on
    recording into that model's recording ([Note: adding to a recorded model]); its config is
    the first block's (pass none here)."""
    if extend is None:
        recording = Recording(load_config(config) if config is not None else None)
    else:
        recording = _recording_to_extend(extend, config)
    _capture_moves_to_meta()
    try:
        with _record_meta_skipping_init(recording), _MetaByDefault(), _Recorder(recording):
            yield recording
    finally:
        recording._scratch.release()
    if recording not in _LIVE:
        _LIVE.append(recording)
    logger.info("infinity.init: %d operations recorded (%d random)", len(recording.ops),
                recording.num_random)


@contextlib.contextmanager
def extend_recording(params: Any) -> Iterator[Recording | None]:
    """Record what runs inside into the recording that owns ``params`` (meta tensors of a model
    built under ``infinity.init``, not initialised yet), as ``init(extend=model)`` does: what
    DeepSpeed's ``zero.GatheredParameters`` means on such a model (edits, new modules, resized
    embeddings replay at ``initialize``). Yields None, recording nothing, when no recording owns
    any of them."""
    recording = next((r for p in params if isinstance(p, torch.Tensor) and p.device == _META
                      for r in _LIVE if r.owns(p)), None)
    if recording is None:
        yield None
        return
    try:
        with _record_meta_skipping_init(recording), _MetaByDefault(), _Recorder(recording):
            yield recording
    finally:
        recording._scratch.release()


def _recording_to_extend(model: Any, config: Any) -> Recording:
    """[Note: adding to a recorded model]
    Whatever wraps a recorded model after its block closed creates real tensors, and may then
    put them on the meta device of the model's tensors, which drops their values. A move by
    ``nn.Module.to`` (peft's adapters) keeps them ([Note: modules moved onto a recorded model]);
    for anything else, ``with infinity.init(extend=model):`` records that code into the model's
    own recording, so its tensors' values replay like any other parameter's, equal to eager
    construction (the random stream is the one eager construction would use at that point)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"infinity.init(extend=...): expected the torch.nn.Module built under an "
                         f"earlier infinity.init block, got {type(model).__name__}")
    if config is not None:
        raise ValueError("infinity.init(config, extend=model): the model's recording keeps the "
                         "config of its first block; pass the config there (or to "
                         "infinity.initialize), not to the block that extends it")
    recording = recording_of(model)
    if recording is None:
        raise ValueError("infinity.init(extend=model): the model has no tensors on the meta "
                         "device, so it was not built under infinity.init (or was initialised "
                         "already); build it under `with infinity.init(config):` first")
    return recording


def recording_of(module: nn.Module) -> Recording | None:
    """The recording that owns ``module``'s meta parameters and buffers, or None when it has
    none. Raises when some meta tensor belongs to no recording (``device='meta'`` by hand)."""
    metas = [(n, t) for n, t in _named_tensors(module) if t.device == _META]
    if not metas:
        return None
    owner = next((r for _, t in metas for r in _LIVE if r.owns(t)), None)
    stray = [n for n, t in metas
             if owner is None or not (owner.owns(t) or _storage_key(t) in _MOVED)]
    if stray:
        added = owner is not None  # next to recorded tensors: added after the block closed
        raise LazyInitError(
            f"{stray[0]!r} is on the meta device but was not built under `with infinity.init(...)` "
            f"(or its model was already initialized); " + (
                f"it was added to the recorded model after its block closed and put on the meta "
                f"device other than by Module.to (which keeps the values: [Note: modules moved "
                f"onto a recorded model]), so its values are gone: add it inside the block, or in "
                f"`with infinity.init(extend=model):` ([Note: adding to a recorded model])"
                if added else
                "build the whole model inside the block, or materialise it first (to_empty() "
                "and initialise)"))
    return owner


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def materialise_placeholders(module: nn.Module, recording: Recording
                             ) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """Swap every meta parameter of ``module`` for a real one of the same shape, dtype and
    ``requires_grad`` whose storage holds 0 bytes (tied parameters stay one object), and every
    meta buffer for its value. Returns ``values_of(param)``: the eager value of a swapped
    parameter (computed on call, one at a time), None for the others."""
    swapped: dict[int, nn.Parameter] = {}
    source: dict[int, torch.Tensor] = {}
    kept: dict[int, torch.Tensor] = {}
    """id(new parameter) -> the value a module moved onto the meta device had ([Note: modules
    moved onto a recorded model])."""
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.device != _META:
                continue
            if id(p) not in swapped:
                empty = torch.empty(0, dtype=p.dtype, device=_CPU).set_(torch.UntypedStorage(0), 0,
                                                                    p.shape)
                new = nn.Parameter(empty, requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # attributes a model set (HF's no-decay flags)
                swapped[id(p)], source[id(new)] = new, p
                moved = _MOVED.pop(_storage_key(p), None)
                if moved is not None:
                    kept[id(new)] = moved[1]
            mod._parameters[name] = swapped[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device == _META:
                moved = _MOVED.pop(_storage_key(b), None)
                mod._buffers[name] = moved[1] if moved is not None else recording.value(b)
    if recording in _LIVE:  # its model is being materialised: nothing else may claim it
        _LIVE.remove(recording)

    replayed = 0

    def values_of(param: torch.Tensor) -> torch.Tensor | None:
        nonlocal replayed
        if id(param) in kept:
            return kept[id(param)].clone()
        meta = source.get(id(param))
        if meta is None:
            return None
        if replayed >= _TRIM_EVERY_BYTES and _malloc_trim() is not None:
            _malloc_trim()(0)  # [Note: heap fragmentation while materialising]
            replayed = 0
        replayed += meta.numel() * meta.element_size()
        return recording.value(meta)

    return values_of


__all__ = ["LazyInitError", "Recording", "extend_recording", "init", "materialise_placeholders",
           "recording_of"]
