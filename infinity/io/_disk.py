"""Free space of the file system a path is (or will be) on: the one probe every pre-write space
check uses, so that tests can stand in a small disk in one place."""

from __future__ import annotations

import os


def existing_ancestor(path: str | os.PathLike[str]) -> str:
    """``path`` itself when it exists, else its nearest existing parent (a directory that is about
    to be created lives on that parent's file system)."""
    current = os.path.abspath(os.fspath(path))
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def free_disk_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged process may still write on the file system of ``path`` (``f_bavail``:
    root's reserved blocks are not counted, so the figure holds for every user)."""
    st = os.statvfs(existing_ancestor(path))
    return st.f_bavail * st.f_frsize
