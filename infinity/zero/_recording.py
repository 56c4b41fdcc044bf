"""The recorded construction program of one ``infinity.init`` block, and its replay.

:class:`Recording` is what ``with infinity.init(...)`` (:mod:`infinity.zero._lazy`) fills: every
aten operation that creates or writes a meta tensor, with its arguments frozen and, for random
operations, the generator state before it. :meth:`Recording.value` replays the slice of that
program a tensor's value depends on, on the CPU ([Note: lazy values equal eager values] in
infinity/zero/_lazy.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from infinity.errors import InfinityError

_META = torch.device("meta")
_CPU = torch.device("cpu")


class LazyInitError(InfinityError, ValueError):
    """A model built under ``infinity.init`` used a construction pattern that cannot be deferred."""


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A meta tensor as an operation saw it: its storage and its geometry at that moment."""

    tensor: torch.Tensor
    """Kept alive so that the storage key (the StorageImpl address) is never reused."""
    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _ref(t: torch.Tensor) -> _Ref:
    return _Ref(t, _storage_key(t), tuple(t.size()), tuple(t.stride()), t.storage_offset(),
                t.dtype)


@dataclasses.dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    """Arguments with meta tensors replaced by :class:`_Ref` and real tensors by copies."""
    reads: frozenset[int]
    """Storage keys of the meta tensors it reads (the ones it writes included)."""
    creates: dict[int, int]
    """Storage key -> index of the output leaf whose storage is new (the op allocated it)."""
    created: list[torch.Tensor]
    """Those outputs, kept alive so that their storage keys are never reused."""
    rng_state: torch.Tensor | None
    generator: torch.Generator | None
    """Random operations: the generator and its state just before the operation ran."""
    overwrites: int | None = None
    """Storage key this operation writes whole without reading what it held
    ([Note: a whole overwrite ends a storage's history]); None for any other operation."""


def _name(func: Any) -> str:
    return getattr(func, "__name__", None) or str(func)


def _is_random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


_OVERWRITING = frozenset(
    getattr(torch.ops.aten, name) for name in (
        "normal_", "uniform_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_",
        "bernoulli_", "zero_", "fill_", "copy_"))
"""In-place operations whose result does not depend on what ``self`` held: the distributions
(their draws depend only on the generator and the other arguments), fills and ``copy_``."""


def _overwritten_key(func: Any, written: list[Any], leaves: list[Any], whole: bool) -> int | None:
    """[Note: a whole overwrite ends a storage's history]
    The storage key a recorded operation overwrites whole, or None. Replaying a parameter's value
    needs only the writes after its storage's last whole overwrite, plus the operation that
    allocated it: an ``nn.Linear`` initialised by ``reset_parameters`` (``kaiming_uniform_``) and
    again by a model's ``_init_weights`` (``normal_``) replays the ``normal_`` alone, from the
    generator state recorded for it, so the values are the same. That halves the random values a
    GPT's set-up replays (its weights are drawn twice while recording, as eager construction
    draws them). ``whole``: the operation is one that writes its target without reading it
    (:data:`_OVERWRITING`, or a recorded init function). Overwritten means: exactly one written
    tensor, it spans its storage (contiguous, offset 0, every byte), and no other argument
    shares that storage (``x.bernoulli_(x)`` reads what it overwrites)."""
    if not whole and getattr(func, "overloadpacket", None) not in _OVERWRITING:
        return None
    targets = [t for t in written if isinstance(t, torch.Tensor)]
    if len(targets) != 1 or targets[0].device != _META:
        return None
    t = targets[0]
    if not (t.is_contiguous() and t.storage_offset() == 0
            and t.numel() * t.element_size() == t.untyped_storage().nbytes()):
        return None
    key = _storage_key(t)
    if any(isinstance(x, torch.Tensor) and x is not t and x.device == _META
           and _storage_key(x) == key for x in leaves):
        return None
    return key


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments the schema marks as written (``self`` of ``uniform_``, ``out=``)."""
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if arg.kwarg_only or i >= len(args):
            if arg.name in kwargs:
                written.append(kwargs[arg.name])
        else:
            written.append(args[i])
    return written


class Recording:
    """The recorded construction program of one ``infinity.init`` block."""

    def __init__(self, config: Any = None):
        self.config = config
        """The block's configuration (validated); ``initialize`` uses it when given none."""
        self.ops: list[_Op] = []
        self.writers: dict[int, list[int]] = {}
        """Storage key -> indices of the ops that created or wrote it, in order."""
        self.num_random = 0
        self.random_numel = 0
        """Elements the recorded random operations fill: what eager construction draws (each also
        ran once here, on scratch memory, to move the generator as eager construction moves it).
        Replaying at ``initialize`` draws those that still show in a value: at most as many."""
        self._scratch = _Scratch()

    # ------------------------------------------------------------------ recording

    def record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run an aten operation (on meta tensors: no bytes) and record it; called by the
        dispatch mode for every operation while the block is open."""
        leaves, _ = tree_flatten((args, kwargs))
        device = kwargs.get("device")
        if not any(isinstance(t, torch.Tensor) and t.device == _META for t in leaves) and \
                (device is None or torch.device(device) != _META):
            return func(*args, **kwargs)  # real tensors only: it runs exactly as it would eagerly
        return self._record(func, args, kwargs, written=_written_args(func, args, kwargs),
                            random=_is_random(func), run=func, whole=False)

    def record_call(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Record a Python init function that does nothing on meta tensors (``trunc_normal_``
        returns early there) as one operation writing its first argument."""
        return self._record(func, args, kwargs, written=[args[0]], random=True,
                            run=lambda *a, **k: args[0], whole=True)

    def _record(self, func: Any, args: tuple, kwargs: dict, *, written: list[Any], random: bool,
                run: Callable[..., Any], whole: bool) -> Any:
        for target in written:
            if isinstance(target, torch.Tensor) and target.device != _META:
                raise LazyInitError(
                    f"{_name(func)}: writes values computed from a tensor built under "
                    f"infinity.init into a real {tuple(target.shape)} tensor; those values do "
                    f"not exist until infinity.initialize. Create that tensor under "
                    f"infinity.init too, or build this part of the model outside the block")
        leaves, _ = tree_flatten((args, kwargs))
        overwrites = _overwritten_key(func, written, leaves, whole)
        rng_state, generator = None, None
        if random:
            generator = kwargs.get("generator") or torch.default_generator
            rng_state = generator.get_state()
            # The generator moves exactly as eager construction moves it.
            _advance_rng(func, args, kwargs, self._scratch, overwritten=overwrites)
        before = {_storage_key(t) for t in leaves
                  if isinstance(t, torch.Tensor) and t.device == _META}
        out = run(*args, **kwargs)
        out_leaves, _ = tree_flatten(out)
        creates: dict[int, int] = {}
        created = []
        for j, t in enumerate(out_leaves):
            if isinstance(t, torch.Tensor) and t.device == _META:
                key = _storage_key(t)
                if key not in before and key not in creates:
                    creates[key] = j
                    created.append(t)
        index = len(self.ops)
        for key in creates.keys() | {_storage_key(t) for t in written
                                     if isinstance(t, torch.Tensor)}:
            self.writers.setdefault(key, []).append(index)
        self.ops.append(_Op(func, *_freeze(args, kwargs, func, out_leaves, creates),
                            reads=frozenset(before), creates=creates, created=created,
                            rng_state=rng_state, generator=generator, overwrites=overwrites))
        if rng_state is not None:
            self.num_random += 1
            filled = [t for t in written if isinstance(t, torch.Tensor)] or created
            self.random_numel += sum(t.numel() for t in filled)
        return out

    # ------------------------------------------------------------------ replay

    def owns(self, t: torch.Tensor) -> bool:
        return t.device == _META and _storage_key(t) in self.writers

    def value(self, t: torch.Tensor) -> torch.Tensor:
        """The CPU value eager construction would have given the meta tensor ``t`` (a fresh
        tensor of ``t``'s shape and dtype, contiguous)."""
        ref = _ref(t)
        if ref.key not in self.writers:
            raise LazyInitError(f"a meta tensor of shape {ref.size} was not created under this "
                                f"infinity.init block; build the whole model inside the block")
        storages = self._replay(self._slice(ref.key))
        value = _view(storages[ref.key], ref)
        if value.is_contiguous() and value.numel() * value.element_size() == \
                storages[ref.key].nbytes():
            return value  # the replay's own storage, which nothing else holds: no copy
        return value.clone(memory_format=torch.contiguous_format)

    def _slice(self, key: int) -> list[int]:
        """Indices of the ops ``key``'s final value depends on, in recorded order: a storage's
        writes back to its last whole overwrite and the op that allocated it
        ([Note: a whole overwrite ends a storage's history]), and, transitively, those of what
        they read."""
        needed: set[int] = set()
        todo = [(key, len(self.ops))]
        seen: set[tuple[int, int]] = set()

        def need(i: int, k: int) -> None:
            if i in needed:
                return
            needed.add(i)
            op = self.ops[i]
            todo.extend((r, i) for r in op.reads if not (r == k and op.overwrites == k))

        while todo:
            k, upto = todo.pop()
            if (k, upto) in seen:
                continue
            seen.add((k, upto))
            writers = self.writers.get(k, ())
            for i in reversed(writers):
                if i >= upto:
                    continue
                need(i, k)
                if self.ops[i].overwrites == k:  # nothing earlier shows; its storage must exist
                    creator = next((j for j in writers if k in self.ops[j].creates), None)
                    if creator is not None:  # None: made before the block (``_thaw`` says so)
                        need(creator, k)
                    break
        return sorted(needed)

    def _replay(self, indices: list[int]) -> dict[int, torch.UntypedStorage]:
        storages: dict[int, torch.UntypedStorage] = {}
        saved = {}
        try:
            for i in indices:
                op = self.ops[i]
                args, kwargs = _thaw(op.args, op.kwargs, storages)
                if op.rng_state is not None:
                    if op.generator not in saved:
                        saved[op.generator] = op.generator.get_state()
                    op.generator.set_state(op.rng_state)
                out = op.func(*args, **kwargs)
                out_leaves, _ = tree_flatten(out)
                for key, j in op.creates.items():
                    storages[key] = out_leaves[j].untyped_storage()
        finally:  # replaying never moves the caller's random stream
            for generator, state in saved.items():
                generator.set_state(state)
        return storages


def _freeze(args: tuple, kwargs: dict, func: Any, out_leaves: list, creates: dict[int, int]
            ) -> tuple[tuple, dict]:
    def freeze(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return _ref(x) if x.device == _META else x.detach().clone()
        if isinstance(x, torch.device) and x.type == "meta":
            return _CPU
        return x

    args, kwargs = tree_map(freeze, args), tree_map(freeze, kwargs)
    schema = getattr(func, "_schema", None)
    if creates and schema is not None and "dtype" in {a.name for a in schema.arguments} and \
            kwargs.get("dtype") is None:
        # A factory without a dtype takes the default dtype of the moment: pin it.
        first = out_leaves[next(iter(creates.values()))]
        kwargs = {**kwargs, "dtype": first.dtype}
    return args, kwargs


def _view(storage: torch.UntypedStorage, ref: _Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=_CPU).set_(storage, ref.offset, ref.size,
                                                             ref.stride)


def _thaw(args: tuple, kwargs: dict, storages: Mapping[int, torch.UntypedStorage]
          ) -> tuple[tuple, dict]:
    def thaw(x: Any) -> Any:
        if isinstance(x, _Ref):
            if x.key not in storages:
                raise LazyInitError(f"a meta tensor of shape {x.size} was created before the "
                                    f"infinity.init block and written inside it; create it "
                                    f"inside the block")
            return _view(storages[x.key], x)
        if isinstance(x, torch.Tensor):
            return x.clone()  # a recorded constant: the op may write it
        return x

    return tree_map(thaw, args), tree_map(thaw, kwargs)


class _Scratch:
    """One growing byte buffer that random operations run on while recording. A fresh tensor per
    operation would fragment the heap (each freed block gets split by the small allocations of
    the meta tensors built in between), holding about the model's size by the end."""

    def __init__(self):
        self._storage = torch.UntypedStorage(0)

    def like(self, t: torch.Tensor, *, zero: bool = True) -> torch.Tensor:
        extent = 1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride())) if t.numel() else 0
        nbytes = extent * t.element_size()
        if self._storage.nbytes() < nbytes:
            self._storage = torch.UntypedStorage(nbytes, device=_CPU)
        view = torch.empty(0, dtype=t.dtype, device=_CPU).set_(self._storage, 0, t.size(),
                                                               t.stride())
        # What an operation overwrites unread need not be defined (a memset of every random
        # value's bytes otherwise); what it reads is zeros, as defined as anything.
        return view.zero_() if zero else view

    def release(self) -> None:
        self._storage = torch.UntypedStorage(0)


def _advance_rng(func: Any, args: tuple, kwargs: dict, scratch: _Scratch, *,
                 overwritten: int | None) -> None:
    """Run a random operation once on throw-away CPU tensors of the same geometry
    (``overwritten``: the storage key the operation overwrites unread, left unzeroed)."""
    def swap(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device == _META:
            return scratch.like(x, zero=_storage_key(x) != overwritten)
        if isinstance(x, torch.device) and x.type == "meta":
            return _CPU
        return x

    leaves, spec = tree_flatten((args, kwargs))
    a, k = tree_unflatten([swap(x) for x in leaves], spec)
    func(*a, **k)
