"""The NVMe swapper: tensors to and from swap files, many requests in flight (the design card's
``infinity.swapper``).

``Swapper(directory, config)`` owns a private directory of swap files (one per key) and a pool of
I/O threads; ``swap_out(key, tensor)`` and ``swap_in(key, out)`` return a :class:`SwapHandle`
whose ``wait()`` re-raises the first error (:class:`~infinity.errors.SwapIOError`, naming the file
and what to do); ``remove``, ``keys``, ``path_of``, ``close``. :class:`SwapperConfig` sets the
block size, the threads and direct I/O; :class:`FileState` is a swap file's state. Reads and
writes are ``O_DIRECT`` where the file system allows it, from page-aligned memory
(:func:`aligned_empty`) without staging.

The public face of the swapper in :mod:`infinity.io` (``infinity/io/_swapper.py``, the file format
in ``_swap_format.py``); the engine reaches it through the tiered store (:mod:`infinity.tiers`).
"""

from infinity.config import SwapperConfig
from infinity.io import FileState, SwapHandle, Swapper, aligned_empty

__all__ = ["FileState", "SwapHandle", "Swapper", "SwapperConfig", "aligned_empty"]
