"""Checkpoints of a tiered table's store that survive a crash: whole or absent, never half.

A checkpoint is a store (`TableStore`'s files and header) frozen at a flush, kept apart from
the working store that write-backs change. Saving one never touches the previous one until
the new one is whole:

1. the store's files are copied into a fresh sibling directory `.<name>.<token>` (a reflink
   where the file system has them, so a 51 GB store costs no copy; else by chunks of 64 MiB,
   so the store may be larger than RAM), each file fsynced, the header written last and
   fsynced, the directory fsynced;
2. a symlink to it replaces `<name>` atomically (`os.replace`), and the parent is fsynced;
3. the directories `<name>` no longer points to (the previous checkpoint, leftovers of saves
   that died) are removed.

A process killed before step 2 leaves `<name>` pointing at the previous checkpoint (and a
leftover directory, removed by the next save); killed after it, at the new one. Write-backs
go to the working store, a copy, so they never reach a checkpoint.

Why not orbax: orbax saves arrays it holds in memory (a `jax.Array` or numpy array per leaf),
and a store may be larger than RAM; its atomic rename is the same idea as here. The store's
own files are already the format, so a checkpoint is a copy of them, and any checkpoint
opens as a store (`TableStore.open(path, readonly=True)`).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
from collections.abc import Sequence
from typing import Any

from jaxembed.tiered.store import TableStore, fsync_dir, write_header

__all__ = ["copy_store", "restore_store", "save_store"]

_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), a reflink of a whole file
_COPY_CHUNK = 64 << 20  # bytes copied a pass where a reflink is refused


def _copy_file(src: str, dst: str) -> None:
    """File `src` copied to the new file `dst` and fsynced: a reflink (copy on write) where
    the file system makes one, else by chunks."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
        except OSError:
            shutil.copyfileobj(fin, fout, _COPY_CHUNK)
        fout.flush()
        os.fsync(fout.fileno())


def copy_store(store: TableStore, dst: str) -> None:
    """The flushed `store`'s files and header copied into the new directory `dst` (made
    here), each file fsynced, the header last, then the directory."""
    os.makedirs(dst)
    for name in store.files():
        _copy_file(os.path.join(store.path, name), os.path.join(dst, name))
    write_header(dst, store.header())  # last: a directory without one is no store


def _parts(path: str) -> tuple[str, str]:
    path = os.path.abspath(os.fspath(path))
    return os.path.dirname(path), os.path.basename(path)


def save_store(store: TableStore, path: str) -> str:
    """A checkpoint of the flushed `store` at `path`, replacing the one there atomically.

    Args:
      store: the store, flushed (`TieredTable.flush`): its files are what is saved.
      path: the checkpoint; a symlink this function made, or nothing.

    Returns:
      The directory the checkpoint's symlink points to.

    Raises:
      ValueError: `path` is the store itself, or something other than a checkpoint.
    """
    parent, name = _parts(path)
    full = os.path.join(parent, name)
    if os.path.realpath(full) == os.path.realpath(store.path):
        raise ValueError(f"the checkpoint path {full!r} is the working store: choose another")
    if os.path.lexists(full) and not os.path.islink(full):
        raise ValueError(
            f"{full!r} exists and is not a checkpoint (a symlink that save makes): remove it "
            "or choose another path"
        )
    os.makedirs(parent, exist_ok=True)
    token = secrets.token_hex(6)
    target = f".{name}.{token}"
    copy_store(store, os.path.join(parent, target))
    link = os.path.join(parent, f".{name}.{token}.link")
    os.symlink(target, link)
    os.replace(link, full)  # the commit: from here on `path` is the new checkpoint
    fsync_dir(parent)
    _remove_others(parent, name, keep=target)
    return os.path.join(parent, target)


def _remove_others(parent: str, name: str, keep: str) -> None:
    """Every `.<name>.*` entry of `parent` but `keep`: previous checkpoints, dead saves."""
    for entry in os.listdir(parent):
        if entry.startswith(f".{name}.") and entry != keep:
            full = os.path.join(parent, entry)
            if os.path.isdir(full) and not os.path.islink(full):
                shutil.rmtree(full, ignore_errors=True)
            else:
                os.remove(full)


def restore_store(
    checkpoint: str,
    path: str,
    *,
    rows: int | None = None,
    dim: int | None = None,
    dtype: Any = None,
    slots: Sequence[str] | None = None,
) -> TableStore:
    """The checkpoint copied to a working store at `path` (replacing one there), checked
    against what the caller expects first.

    Args:
      checkpoint: a checkpoint's path (`save_store`).
      path: the working store's directory; a store there is replaced (its header goes
        first, so a restore that dies leaves no store, never a mixed one).
      rows, dim, dtype, slots: what the caller expects (None: any), as `TableStore.open`.

    Returns:
      The working store, open for reading and writing.

    Raises:
      FileNotFoundError: no checkpoint at `checkpoint`.
      ValueError: a checkpoint of another shape, dtype or slots, naming both; a `path` that
        is a symlink (a checkpoint) or a directory holding other files than a store's.
    """
    try:
        saved = TableStore.open(checkpoint, rows=rows, dim=dim, dtype=dtype, slots=slots,
                                readonly=True)  # fmt: skip
    except ValueError as e:
        raise ValueError(f"cannot restore the checkpoint {os.fspath(checkpoint)!r}: {e}") from e
    parent, name = _parts(path)
    full = os.path.join(parent, name)
    if os.path.islink(full):
        raise ValueError(
            f"{full!r} is a symlink (a checkpoint?), not a working store: restore into the "
            "store's own directory"
        )
    tmp = os.path.join(parent, f".{name}.restore-{secrets.token_hex(6)}")
    copy_store(saved, tmp)
    if os.path.isdir(full):
        strange = [f for f in os.listdir(full)
                   if not (f.endswith(".bin") or f.startswith("header.json"))]  # fmt: skip
        if strange:
            shutil.rmtree(tmp)
            raise ValueError(
                f"{full!r} holds {sorted(strange)[:3]}, so it is not a store to replace: "
                "restore into a new directory or a store's"
            )
        header = os.path.join(full, "header.json")
        if os.path.exists(header):
            os.remove(header)  # the old store is no store from here
            fsync_dir(full)
        shutil.rmtree(full)
    os.replace(tmp, full)
    fsync_dir(parent)
    return TableStore.open(full)
