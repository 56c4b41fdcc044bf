"""Builds (once per machine) and loads the compiled CPU Adam kernel ``csrc/cpu_adam.cpp``.

Why ctypes and a plain C ABI instead of ``torch.utils.cpp_extension.load``: the kernel needs no torch
headers, so it compiles with one ``g++`` call in about a second (a pybind11/ATen extension takes ~40 s),
it does not depend on torch's C++ ABI, and a ctypes call releases the GIL for its whole duration, which
is what lets the optimizer step overlap with the I/O threads.

The shared library is cached under ``$INFINITY_CACHE_DIR`` (default ``$XDG_CACHE_HOME/infinity`` or
``~/.cache/infinity``) in a directory keyed by a hash of the source, the compiler flags, the compiler
and the CPU's flags, so it is rebuilt only when one of those changes. Concurrent first builds (pytest
workers, distributed ranks) serialize on a file lock. When no compiler is found or the build fails,
:func:`load` returns ``None`` and the caller falls back to its pure-torch path; the reason (the
compiler's own error output for a failed build) is logged as a warning and kept for
:func:`load_error`, so the fallback never has to guess why.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading

logger = logging.getLogger(__name__)

SOURCE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "cpu_adam.cpp")
_LIB_NAME = "libinfinity_cpu_adam.so"
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-math-errno")
VARIANT_FLAGS = {
    # "native": every instruction set this CPU has (AVX-512 path where available).
    "native": ("-march=native",),
    # "scalar": the portable loop only; built by the tests to cover the non-AVX-512 code.
    "scalar": ("-march=native", "-DINFINITY_FORCE_SCALAR"),
}

# dtype codes shared with csrc/cpu_adam.cpp (enum DType).
DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_NONE = 0, 1, 2, 3


class AdamHyper(ctypes.Structure):
    """Mirror of ``InfinityAdamHyper`` in csrc/cpu_adam.cpp (same field order and types)."""

    _fields_ = [(name, ctypes.c_float) for name in (
        "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps", "step_size", "bc2_sqrt",
        "decay", "l2", "grad_scale")] + [("seed", ctypes.c_uint32), ("flags", ctypes.c_int32)]


_libs: dict[str, ctypes.CDLL | None] = {}  # variant -> loaded library, or None when the build failed
_errors: dict[str, str] = {}  # variant -> why it could not be loaded (the compiler's stderr included)
_lock = threading.Lock()


def cache_dir() -> str:
    root = os.environ.get("INFINITY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "infinity")
    return os.path.join(root, "cpu_adam")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def _build_key(cxx: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    with open(SOURCE_PATH, "rb") as f:
        h.update(f.read())
    h.update(" ".join((cxx, *flags)).encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def _build(cxx: str, flags: tuple[str, ...], lib_path: str, source: str | None = None) -> None:
    """Compile ``source`` (the kernel by default) into a temporary file, then rename, so a reader
    never sees a half-written library. A failed compile raises with the compiler's stderr."""
    os.makedirs(os.path.dirname(lib_path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(lib_path))
    os.close(fd)
    cmd = [cxx, *flags, source or SOURCE_PATH, "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"building the CPU Adam kernel failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        os.replace(tmp, lib_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.infinity_adam_step.argtypes = [vp, vp, ci, vp, vp, ci, vp, ci, i64, ctypes.POINTER(AdamHyper), ci]
    lib.infinity_adam_step.restype = ci
    lib.infinity_adam_isa.argtypes = []
    lib.infinity_adam_isa.restype = ci
    lib.infinity_memory_probe.argtypes = [vp, vp, vp, vp, i64, ci]
    lib.infinity_memory_probe.restype = None
    return lib


def library_path(variant: str = "native") -> str | None:
    """Where the library for ``variant`` lives (or would be built); None without a compiler."""
    cxx = _compiler()
    if cxx is None:
        return None
    flags = BASE_FLAGS + VARIANT_FLAGS[variant]
    return os.path.join(cache_dir(), f"{variant}-{_build_key(cxx, flags)}", _LIB_NAME)


def load(variant: str = "native", *, raise_on_error: bool = False) -> ctypes.CDLL | None:
    """Return the kernel library, building it on first use; None (or raise) when it cannot be built."""
    if variant not in VARIANT_FLAGS:
        raise ValueError(f"unknown kernel variant {variant!r}; expected one of {sorted(VARIANT_FLAGS)}")
    with _lock:
        if variant in _libs and (_libs[variant] is not None or not raise_on_error):
            return _libs[variant]
        try:
            _libs[variant] = _load_locked(variant)
            _errors.pop(variant, None)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _libs[variant] = None
            _errors[variant] = str(e)
            if raise_on_error:
                raise RuntimeError(f"CPU Adam kernel unavailable: {e}") from e
            # A warning, with the compiler's output: a silent fallback costs 3-10x in every step.
            logger.warning("CPU Adam kernel unavailable (falling back to the pure-torch path): %s", e)
        return _libs[variant]


def load_error(variant: str = "native") -> str | None:
    """Why the last :func:`load` of ``variant`` failed (the compiler's error for a failed build);
    None when it loaded or was never tried."""
    return _errors.get(variant)


def _load_locked(variant: str) -> ctypes.CDLL:
    if not os.path.exists(SOURCE_PATH):
        raise RuntimeError(f"kernel source {SOURCE_PATH} is missing from this install")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    lib_path = library_path(variant)
    assert lib_path is not None
    if not os.path.exists(lib_path):
        os.makedirs(os.path.dirname(lib_path), exist_ok=True)
        with open(os.path.join(os.path.dirname(lib_path), ".lock"), "w") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)  # another process may be building the same key
            if not os.path.exists(lib_path):
                logger.info("building the CPU Adam kernel (%s) into %s", variant, lib_path)
                _build(cxx, BASE_FLAGS + VARIANT_FLAGS[variant], lib_path)
    return _declare(ctypes.CDLL(lib_path))


if __name__ == "__main__":  # python -m infinity.optim._cpu_adam_ext: build now (e.g. in a Docker layer)
    for v in sys.argv[1:] or ["native"]:
        lib = load(v, raise_on_error=True)
        print(v, library_path(v), "avx512" if lib.infinity_adam_isa() else "scalar")
