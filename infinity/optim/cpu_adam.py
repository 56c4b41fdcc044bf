"""Adam/AdamW on flat CPU tensors in one streaming pass, and a drop-in ``torch.optim.Optimizer``.

What one pass does, per element (see ``csrc/cpu_adam.cpp``): scale the gradient (loss-scale inverse
times clip coefficient, ``grad_scale``), add L2 (``adamw_mode=False``) or decay the weight
(``adamw_mode=True``), update both moments, update the fp32 master, and write the bf16/fp16 copy of
the new parameter (``out``). Adam is memory-bound (28 bytes per parameter in fp32), so doing the
scaling and the copy-out while the data is in registers is what makes it fast: a separate
``grad.mul_``/``param.to(bfloat16)`` costs a full extra trip through DRAM each.

Backends, chosen per call (env ``INFINITY_CPU_ADAM_BACKEND``, default ``auto``):
``native``: the compiled kernel (AVX-512 where the CPU has it), built once per machine and cached
(``infinity/optim/_cpu_adam_ext.py``); ``scalar``: the same kernel's portable loop; ``torch``: a pure-torch
path over cache-sized chunks, taken with one warning when no compiler is available. All three
release the GIL while they compute, so the step overlaps with I/O threads.

bf16 moments ([Note: bf16 moments use stochastic rounding]): ``exp_avg``/``exp_avg_sq`` may be
bf16, cutting the bytes per parameter from 28 to 20. Round-to-nearest would stall them: with
``beta2 = 0.999`` the per-step change of ``exp_avg_sq`` is ~0.1 % of its value, below bf16's
0.4 % resolution, so it would never move. We store them with stochastic rounding instead (round up
with probability equal to the dropped fraction, from a counter-based hash of (index, step, seed)):
the stored value is unbiased, each store adds a zero-mean error of at most one bf16 ulp (relative
2^-8), and the EMA averages those errors out. Results are deterministic for a given seed and step
and do not depend on the thread count. The test suite checks thousands of steps against fp32.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
import mmap
import os
import warnings
from typing import Any, Iterable

import torch

from infinity._common import warn_once
from infinity.io import huge_pages_pay_off
from infinity.optim import _cpu_adam_ext as _ext

logger = logging.getLogger(__name__)

BACKEND_ENV = "INFINITY_CPU_ADAM_BACKEND"
BACKENDS = ("auto", "native", "scalar", "torch")
_GRAD_DTYPES = {torch.float32: _ext.DTYPE_F32, torch.bfloat16: _ext.DTYPE_BF16, torch.float16: _ext.DTYPE_F16}
_STATE_DTYPES = {torch.float32: _ext.DTYPE_F32, torch.bfloat16: _ext.DTYPE_BF16}
_OUT_DTYPES = {torch.bfloat16: _ext.DTYPE_BF16, torch.float16: _ext.DTYPE_F16}
# 4 MiB per fp32 stream: the fallback's ~6 streams stay in L3, and few chunks mean few thread
# fork/joins (each costs a scheduler quantum when the cores are oversubscribed).
_TORCH_CHUNK_NUMEL = 1 << 20


# ------------------------------------------------------------------------------------------ backend
def _requested_backend() -> str:
    name = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r} is not a backend; use one of {', '.join(BACKENDS)}")
    return name


def _kernel() -> ctypes.CDLL | None:
    """The compiled library for the requested backend, or None for the pure-torch path."""
    name = _requested_backend()
    if name == "torch":
        return None
    if name in ("native", "scalar"):  # asked for explicitly: a failed build is an error
        return _ext.load(name, raise_on_error=True)
    lib = _ext.load("native")
    if lib is None:
        # The real reason (no compiler, or the compiler's own error) is in the message: a guess
        # here sent people looking for a compiler they had while the source failed to compile.
        reason = _ext.load_error("native") or "unknown reason"
        warn_once("cpu_adam.fallback", "infinity.optim.cpu_adam: the compiled kernel could not be built; "
                  "using the slower pure-torch path. Fix the cause below (install g++ if none was "
                  f"found) and it is built once, on next start. Cause: {reason}")
    return lib


def backend() -> str:
    """Which implementation ``adam_step_flat`` uses now: 'native-avx512', 'native-scalar', 'scalar' or 'torch'."""
    lib = _kernel()
    if lib is None:
        return "torch"
    if _requested_backend() == "scalar":
        return "scalar"
    return "native-avx512" if lib.infinity_adam_isa() else "native-scalar"


def memory_probe(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, *, num_threads: int | None = None) -> bool:
    """[memory probe] in csrc/cpu_adam.cpp: the fp32 step's memory traffic without its
    arithmetic (read the four fp32 streams, write three back: 28 bytes a parameter, over the
    kernel's threads and chunks), so ``infinity bench adam`` can say how close the step is to
    the memory's limit. Changes the tensors (adds ``grad`` to the other three). Returns False,
    doing nothing, without the compiled kernel (the pure-torch path has no such loop)."""
    lib = _kernel()
    if lib is None:
        return False
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq)):
        _check_tensor(name, t, param.numel(), {torch.float32: 0}, "memory_probe")
    threads = max(1, int(num_threads or torch.get_num_threads()))
    lib.infinity_memory_probe(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                              exp_avg_sq.data_ptr(), param.numel(), threads)
    return True


# ------------------------------------------------------------------------------------------ memory
# [Note: state memory layout] Measured here (one core, 64M parameters, CPU time, same process):
#   fp32 moments: 49 ms on 4 KiB pages, 69 ms on 2 MiB pages all aligned alike, 40 ms on 2 MiB
#   pages with each buffer shifted by a different offset; bf16 moments: 48, 32, 31 ms.
# Huge pages remove the TLB misses of 5-8 concurrent streams; but on huge pages, equally aligned
# buffers put p[i], g[i], m[i], v[i] in the same L2 set, and the prefetched lines evict each other.
# Shifting each buffer by a distinct non-power-of-two number of bytes spreads them over the sets.
_HUGEPAGE_MIN_BYTES = 4 << 20
_STAGGER_BYTES = 3 * 4096 + 5 * 64
_stagger_counter = itertools.count()


def zeros_host(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled flat CPU tensor laid out for streaming; see [Note: state memory layout].

    From 4 MiB up, where huge pages pay off ([Note: when huge pages cost more than they save] in
    infinity/io/_huge_pages.py): anonymous memory advised to use transparent huge pages, the
    tensor starting at a different offset for each call (cycling over 32 offsets). Otherwise
    ``torch.zeros``.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (numel * itemsize < _HUGEPAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE")
            or not huge_pages_pay_off()):
        return torch.zeros(numel, dtype=dtype)
    offset = (next(_stagger_counter) % 32) * _STAGGER_BYTES
    buf = mmap.mmap(-1, offset + numel * itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP set to "never": still correct, on 4 KiB pages
        pass
    with warnings.catch_warnings():  # frombuffer warns that it cannot tell the buffer is writable
        warnings.simplefilter("ignore")
        t = torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset)  # keeps `buf` alive
    return t.zero_()  # fault the pages in now, not inside the first step


# ------------------------------------------------------------------------------------------ checks
def _check_tensor(name: str, t: Any, numel: int | None, dtypes: dict, where: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{where}: `{name}` must be a CPU tensor, got device {t.device}; move it with .cpu()")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{where}: `{name}` has dtype {str(t.dtype).replace('torch.', '')}; expected one of {allowed}")
    if not t.is_contiguous():
        raise ValueError(f"{where}: `{name}` must be contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                         "pass a flat contiguous buffer or call .contiguous()")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{where}: `{name}` has {t.numel()} elements but `param` has {numel}; "
                         "all flat buffers of one step must have the same size")


def check_hyperparameters(*, lr: Any, beta1: Any, beta2: Any, eps: Any, weight_decay: Any,
                          where: str = "CPUAdam") -> None:
    """Reject values torch.optim.AdamW rejects too, naming the field."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}: tensor `lr` must have one element, got shape {tuple(lr.shape)}")
    for name, value, low, high in (("lr", lr, 0.0, math.inf), ("beta1", beta1, 0.0, 1.0),
                                   ("beta2", beta2, 0.0, 1.0), ("eps", eps, 0.0, math.inf),
                                   ("weight_decay", weight_decay, 0.0, math.inf)):
        v = float(value)
        if not (low <= v < high) or math.isnan(v):
            raise ValueError(f"{where}: invalid `{name}` {v}; expected {low} <= {name} < {high}")


# ------------------------------------------------------------------------------------------ flat step
def adam_step_flat(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float, beta2: float,
                   eps: float, weight_decay: float, adamw_mode: bool = True, bias_correction: bool = True,
                   grad_scale: float = 1.0, out: torch.Tensor | None = None, seed: int = 0,
                   num_threads: int | None = None) -> None:
    """One Adam (``adamw_mode=False``) or AdamW update of flat contiguous CPU tensors, in place.

    ``param`` is the fp32 master; ``grad`` is fp32, bf16 or fp16 and is multiplied by ``grad_scale``
    first; ``exp_avg``/``exp_avg_sq`` are both fp32 or both bf16 (stochastic rounding, see the module
    docstring); ``out`` (bf16 or fp16, same numel) receives the updated parameters in the same pass.
    ``step`` is the 1-based step count after this update (as in torch's ``state['step']``). ``seed``
    selects the rounding stream of bf16 moments; ``num_threads`` defaults to ``torch.get_num_threads()``.
    Releases the GIL while it computes.
    """
    where = "adam_step_flat"
    _check_tensor("param", param, None, {torch.float32: 0}, where)
    n = param.numel()
    _check_tensor("grad", grad, n, _GRAD_DTYPES, where)
    _check_tensor("exp_avg", exp_avg, n, _STATE_DTYPES, where)
    _check_tensor("exp_avg_sq", exp_avg_sq, n, _STATE_DTYPES, where)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(f"{where}: `exp_avg` is {exp_avg.dtype} but `exp_avg_sq` is {exp_avg_sq.dtype}; "
                         "both moments must have the same dtype")
    if out is not None:
        _check_tensor("out", out, n, _OUT_DTYPES, where)
    if isinstance(step, bool) or int(step) != step or step < 1:
        raise ValueError(f"{where}: `step` must be an integer >= 1 (the count after this update), got {step!r}")
    check_hyperparameters(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, where=where)
    if n == 0:
        return
    lr, beta1, beta2, wd = float(lr), float(beta1), float(beta2), float(weight_decay)
    bc1 = 1.0 - beta1 ** step if bias_correction else 1.0
    bc2 = 1.0 - beta2 ** step if bias_correction else 1.0
    hyper = _ext.AdamHyper(
        beta1=beta1, beta2=beta2, one_minus_beta1=1.0 - beta1, one_minus_beta2=1.0 - beta2,
        eps=float(eps), step_size=lr / bc1, bc2_sqrt=math.sqrt(bc2), decay=1.0 - lr * wd, l2=wd,
        grad_scale=float(grad_scale), seed=rounding_seed(seed, int(step)),
        flags=(1 if adamw_mode and wd != 0.0 else 0) | (2 if not adamw_mode and wd != 0.0 else 0))
    threads = max(1, int(num_threads or torch.get_num_threads()))
    lib = _kernel()
    if lib is None:
        _adam_step_torch(param.view(-1), grad.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1),
                         None if out is None else out.view(-1), hyper)
        return
    rc = lib.infinity_adam_step(
        param.data_ptr(), grad.data_ptr(), _GRAD_DTYPES[grad.dtype], exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(), _STATE_DTYPES[exp_avg.dtype],
        None if out is None else out.data_ptr(), _ext.DTYPE_NONE if out is None else _OUT_DTYPES[out.dtype],
        n, ctypes.byref(hyper), threads)
    if rc != 0:  # dtypes were checked above, so this is a kernel/loader mismatch
        raise RuntimeError(f"{where}: kernel rejected the dtype combination (code {rc}); rebuild with "
                           "`python -m infinity.optim._cpu_adam_ext` after clearing the cache dir "
                           f"{_ext.cache_dir()}")


def rounding_seed(seed: int, step: int) -> int:
    """The rounding stream of bf16 moments at ``step`` (the kernel's ``hash32`` mixing)."""
    x = (int(seed) * 0x85EBCA77 + step * 0xC2B2AE3D + 0x27D4EB2F) & 0xFFFFFFFF
    for mul in (0x7FEB352D, 0x846CA68B):  # same mixing as hash32 in the kernel
        x ^= x >> 16
        x = (x * mul) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _adam_step_torch(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor | None, h: _ext.AdamHyper) -> None:
    """The same math in torch ops over L2-sized chunks (no compiler needed; a few passes per chunk)."""
    n = p.numel()
    c = min(n, _TORCH_CHUNK_NUMEL)
    gbuf, dbuf = torch.empty(c), torch.empty(c)
    low_state = m.dtype != torch.float32
    mbuf, vbuf = (torch.empty(c), torch.empty(c)) if low_state else (None, None)
    gen = torch.Generator().manual_seed(h.seed)
    for start in range(0, n, c):
        k = min(c, n - start)
        pc, gc, dc = p[start:start + k], gbuf[:k], dbuf[:k]
        gc.copy_(g[start:start + k]).mul_(h.grad_scale)
        if h.flags & 2:
            gc.add_(pc, alpha=h.l2)
        if h.flags & 1:
            pc.mul_(h.decay)
        mc = mbuf[:k].copy_(m[start:start + k]) if low_state else m[start:start + k]
        vc = vbuf[:k].copy_(v[start:start + k]) if low_state else v[start:start + k]
        mc.lerp_(gc, h.one_minus_beta1)
        vc.mul_(h.beta2).addcmul_(gc, gc, value=h.one_minus_beta2)
        torch.sqrt(vc, out=dc).div_(h.bc2_sqrt).add_(h.eps)
        pc.addcdiv_(mc, dc, value=-h.step_size)
        if low_state:
            store_stochastic_bf16(m[start:start + k], mc, gen)
            store_stochastic_bf16(v[start:start + k], vc, gen)
        if out is not None:
            out[start:start + k].copy_(pc)


def store_stochastic_bf16(dst: torch.Tensor, src_fp32: torch.Tensor, gen: torch.Generator) -> None:
    """bf16 stochastic rounding in torch ops on any device (``gen`` on that device; clobbers
    ``src_fp32``); NaN stays NaN."""
    nan = torch.isnan(src_fp32)
    bits = src_fp32.view(torch.int32)
    bits.add_(torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device,
                            generator=gen)).bitwise_and_(-65536)
    src_fp32.masked_fill_(nan, float("nan"))
    dst.copy_(src_fp32)  # exact: the low 16 bits are zero


# ------------------------------------------------------------------------------------------ optimizer
# Options of torch.optim.Adam/AdamW that change the math or the execution and that CPUAdam does not
# implement, with the value that means "off". Passing "off" is accepted (it is what CPUAdam does);
# anything else raises instead of being silently ignored.
_UNSUPPORTED_OFF = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                    "differentiable": False, "fused": None}


def _reject_options(options: dict, where: str) -> None:
    for key, value in options.items():
        if key not in _UNSUPPORTED_OFF:
            raise ValueError(f"{where}: unknown option `{key}`; CPUAdam accepts lr, betas, eps, "
                             "weight_decay, adamw_mode, bias_correction")
        if value not in (_UNSUPPORTED_OFF[key], False, None):
            raise ValueError(f"{where}: `{key}={value!r}` is not supported by CPUAdam (it always runs "
                             f"its own fused CPU kernel); remove the option")


class CPUAdam(torch.optim.Optimizer):
    """Drop-in for ``torch.optim.AdamW`` (``adamw_mode=True``) and ``torch.optim.Adam`` (False) on CPU.

    Each parameter is updated by :func:`adam_step_flat`. fp32 parameters are updated in place;
    bf16/fp16 parameters get an fp32 master in ``state['master_param']`` and receive its rounded copy
    in the same pass. ``state_dtype=torch.bfloat16`` keeps the moments in bf16 (see the module
    docstring). State dicts load both ways with torch.optim.AdamW/Adam (same keys: ``step``,
    ``exp_avg``, ``exp_avg_sq``); ``bias_correction=False`` has no AdamW equivalent and is lost there.
    """

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw_mode: bool = True, bias_correction: bool = True, *,
                 state_dtype: torch.dtype = torch.float32, **options: Any):
        _reject_options(options, "CPUAdam()")
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"CPUAdam(): `state_dtype` must be torch.float32 or torch.bfloat16, got {state_dtype}")
        self.state_dtype = state_dtype  # dtype of exp_avg/exp_avg_sq for every parameter
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=bool(adamw_mode),
                        bias_correction=bool(bias_correction))
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        extra = {k: param_group[k] for k in _UNSUPPORTED_OFF if k in param_group}
        _reject_options(extra, "CPUAdam param group")
        group = {k: v for k, v in param_group.items() if k not in _UNSUPPORTED_OFF}
        super().add_param_group(group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        beta1, beta2 = group["betas"]
        check_hyperparameters(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                              weight_decay=group["weight_decay"], where=f"CPUAdam param group {gi}")
        for pi, p in enumerate(group["params"]):
            if p.device.type != "cpu":
                raise ValueError(f"CPUAdam: parameter {pi} of group {gi} is on device {p.device}; "
                                 "CPUAdam steps CPU tensors (use torch.optim.AdamW on accelerators)")
            if p.dtype not in _GRAD_DTYPES:
                raise ValueError(f"CPUAdam: parameter {pi} of group {gi} has dtype {p.dtype}; "
                                 "supported: float32, bfloat16, float16")

    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)  # a tensor, like torch.optim.AdamW
        # see [Note: state memory layout]
        state["exp_avg"] = zeros_host(p.numel(), self.state_dtype).view(p.shape)
        state["exp_avg_sq"] = zeros_host(p.numel(), self.state_dtype).view(p.shape)
        if p.dtype != torch.float32:
            state["master_param"] = zeros_host(p.numel(), torch.float32).view(p.shape).copy_(p.detach())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = (float(b) for b in group["betas"])
            hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                         weight_decay=float(group["weight_decay"]), adamw_mode=group["adamw_mode"],
                         bias_correction=group["bias_correction"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("CPUAdam does not support sparse gradients; use torch.optim.SparseAdam")
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1
                self._step_param(p, state, int(state["step"].item()), hyper)
        return loss

    def _step_param(self, p: torch.Tensor, state: dict[str, Any], step: int, hyper: dict[str, Any]) -> None:
        grad = p.grad.contiguous()
        if grad.dtype not in _GRAD_DTYPES:
            grad = grad.to(torch.float32)
        master = state.get("master_param")
        if master is None:  # fp32 parameter: update it in place (through a copy if it is strided)
            flat = p.data if p.data.is_contiguous() else p.data.contiguous()
            adam_step_flat(flat.view(-1), grad.view(-1), state["exp_avg"].view(-1),
                           state["exp_avg_sq"].view(-1), step=step, out=None, **hyper)
            if flat.data_ptr() != p.data.data_ptr():
                p.data.copy_(flat)
            return
        low = p.data if p.data.is_contiguous() else torch.empty(p.shape, dtype=p.dtype)
        adam_step_flat(master.view(-1), grad.view(-1), state["exp_avg"].view(-1),
                       state["exp_avg_sq"].view(-1), step=step, out=low.view(-1), **hyper)
        if low.data_ptr() != p.data.data_ptr():
            p.data.copy_(low)

    # ---------------------------------------------------------------------------- state dicts
    def state_dict(self) -> dict[str, Any]:
        """torch's layout plus the keys torch.optim.Adam/AdamW expect, so either loads it."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group.update(_UNSUPPORTED_OFF)
            group["decoupled_weight_decay"] = group["adamw_mode"]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by CPUAdam or by torch.optim.AdamW/Adam."""
        sd = dict(state_dict)
        groups = []
        for gi, (saved, mine) in enumerate(zip(sd["param_groups"], self.param_groups)):
            for key in ("amsgrad", "maximize"):
                if saved.get(key):
                    raise ValueError(f"load_state_dict: param group {gi} was saved with `{key}=True`, "
                                     "which CPUAdam does not implement")
            group = {k: v for k, v in saved.items() if k not in _UNSUPPORTED_OFF and k != "decoupled_weight_decay"}
            group["adamw_mode"] = bool(saved.get("decoupled_weight_decay", saved.get("adamw_mode", mine["adamw_mode"])))
            group.setdefault("bias_correction", mine["bias_correction"])
            groups.append(group)
        sd["param_groups"] = groups + list(sd["param_groups"][len(groups):])
        saved_state = sd["state"]
        super().load_state_dict(sd)  # checks group/param counts; casts state to the param dtype
        params = [p for g in self.param_groups for p in g["params"]]
        index = [i for g in groups for i in g["params"]]
        for i, p in zip(index, params):  # redo the casts: moments in state_dtype, master in fp32
            if i not in saved_state:
                continue
            src, state = saved_state[i], self.state[p]
            state["step"] = torch.tensor(float(src["step"]), dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = zeros_host(p.numel(), self.state_dtype).view(p.shape).copy_(src[key].reshape(p.shape))
            if p.dtype != torch.float32:
                master = src.get("master_param", p.detach())
                state["master_param"] = zeros_host(p.numel(), torch.float32).view(p.shape).copy_(master.reshape(p.shape))
            else:
                state.pop("master_param", None)
