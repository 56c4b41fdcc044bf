"""Moving bytes between memory and files: the NVMe swapper, its file format, aligned host memory,
and safetensors read and written by byte range.

- :class:`Swapper` (:mod:`._swapper`): aligned ``O_DIRECT`` reads and writes of tensors to one
  swap file per key, many requests in flight, every result checked; ``swap_in``/``swap_out``
  return a :class:`SwapHandle` whose ``wait()`` re-raises the first error. ``swapper.activity``
  (a :class:`DiskActivity`, :mod:`._disk_activity`): the seconds reads, writes and both were in
  flight ([Note: disk activity]; ``snapshot()`` gives them so far).
- :mod:`._swap_format`: the swap file's header, names and states ([Note: swap file layout]).
- :func:`aligned_empty` / :func:`aligned_view` (:mod:`._aligned`): page-aligned host memory that
  direct I/O reads into without staging; :func:`advise_direct_io_range`: huge pages for a range
  the disk will move ([Note: direct I/O wants huge pages] in ``_huge_pages.py``);
  :func:`release_pages` / :func:`populate_pages`: give a range's pages back to the kernel, fault
  them in without writing.
- :func:`huge_pages_pay_off` (:mod:`._huge_pages`): whether large host buffers the CPU works in
  are advised to use transparent huge pages on this machine (decided once per process).
- :func:`manage_mmap_threshold`, :func:`activations_in_heap`, :func:`engine_buffers`
  (:mod:`._host_malloc`): glibc's mmap threshold, so that the engine's buffers leave the process
  when freed while the model's activations reuse heap memory.
- :func:`free_disk_bytes` (:mod:`._disk`): free space of a path's file system, for the checks
  that run before anything is written.
- :mod:`._safetensors`: streaming safetensors files (:class:`SafetensorsFile`), Hugging Face
  sharded checkpoints (:class:`SafetensorsCheckpoint`), atomic writes (:func:`write_safetensors`).

Knows nothing of tiers, units or the engine; only ``config.SwapperConfig`` from above the floor.
"""

from infinity.io._aligned import (DEFAULT_ALIGNMENT_BYTES, HUGE_PAGE_BYTES, address_of,
                                  advise_direct_io_range, advise_huge_pages, aligned_empty,
                                  aligned_view, memory_at, pin_device_for, pinned_staging_ring,
                                  populate_pages, release_pages)
from infinity.io._disk import free_disk_bytes
from infinity.io._disk_activity import DiskActivity
from infinity.io._host_malloc import activations_in_heap, engine_buffers, manage_mmap_threshold
from infinity.io._huge_pages import huge_pages_pay_off
from infinity.io._safetensors import (INDEX_NAME, SafetensorsCheckpoint, SafetensorsError,
                                      SafetensorsFile, TensorEntry, fsync_dir, iter_tensors,
                                      write_safetensors)
from infinity.io._swap_format import FileState
from infinity.io._swapper import SwapHandle, Swapper

__all__ = ["DEFAULT_ALIGNMENT_BYTES", "HUGE_PAGE_BYTES", "INDEX_NAME", "DiskActivity", "FileState",
           "SafetensorsCheckpoint", "SafetensorsError", "SafetensorsFile", "SwapHandle", "Swapper",
           "TensorEntry", "activations_in_heap", "address_of", "advise_direct_io_range",
           "advise_huge_pages", "aligned_empty", "aligned_view", "engine_buffers",
           "free_disk_bytes", "fsync_dir", "huge_pages_pay_off", "iter_tensors",
           "manage_mmap_threshold", "memory_at", "pin_device_for", "pinned_staging_ring",
           "populate_pages", "release_pages", "write_safetensors"]
