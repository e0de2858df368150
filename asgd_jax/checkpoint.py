"""Atomic checkpoints of pytrees of arrays.

A checkpoint is one ``.npz`` file holding the leaves of a state pytree plus named host arrays and a JSON header. It
is written to a temporary file in the same folder and moved into place with :func:`os.replace`, so a process killed
mid-write leaves the previous checkpoint intact. Loading restores the leaves into the structure of a template (a
freshly initialised state), which also checks that shapes and dtypes still fit.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import uuid
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from asgd_jax import errors

__all__ = [
    "Writer",
    "atomic_write",
    "load",
    "load_model",
    "read_header",
    "read_json",
    "save",
    "save_model",
    "write_json",
    "write_json_lines",
]

_HEADER = "__header__"
_DTYPES = "__dtypes__"  # each leaf's dtype, by name (a checkpoint written before they were kept has none)


def save(path: str | os.PathLike, state: Any, arrays: dict[str, np.ndarray], header: dict[str, Any]) -> None:
    """Writes ``state`` (a pytree of arrays), extra host ``arrays`` and a JSON ``header`` atomically to ``path``.

    A leaf of a dtype NumPy does not know (ml_dtypes' bfloat16, float8, int4: ``.npz`` would keep raw bytes, or a
    descriptor ``np.load`` cannot read) is stored as unsigned integers of its size, its dtype's name beside it."""
    leaves = [np.asarray(x) for x in jax.device_get(jax.tree.leaves(state))]
    payload: dict[str, Any] = {f"leaf_{i:05d}": _storable(x) for i, x in enumerate(leaves)}
    payload.update({f"array_{k}": np.asarray(v) for k, v in arrays.items()})
    payload[_HEADER] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    payload[_DTYPES] = np.frombuffer(json.dumps([str(x.dtype) for x in leaves]).encode(), np.uint8)
    atomic_write(path, lambda f: np.savez(f, **payload), suffix=".npz")


def atomic_write(
    path: str | os.PathLike, write: Callable[[Any], Any], *, mode: str = "wb", suffix: str = "", fsync: bool = True
) -> None:
    """``write(file)`` into a temporary file beside ``path`` (``.tmp-<random><suffix>``), flushed to disk (unless not
    ``fsync``), then moved into place: a process killed, or a disk filled, mid-write leaves the previous file whole,
    or none, never half of one. The file gets the modes any file of the process gets (the umask, a folder's default
    ACL; mkstemp's are the owner's alone)."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp-{uuid.uuid4().hex}{suffix}")  # this write's own (other writers may share it)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path: str | os.PathLike, value: Any) -> None:
    """Writes ``value`` as JSON to ``path`` atomically (a temporary file in the same folder, then a rename)."""
    atomic_write(path, lambda f: json.dump(value, f, indent=1, default=str), mode="w", suffix=".json")


def write_json_lines(path: str | os.PathLike, records: list[Any]) -> None:
    """Writes ``records`` as JSON lines (one ``json.dumps`` each) to ``path`` atomically, as :func:`write_json`."""
    atomic_write(path, lambda f: f.writelines(json.dumps(r) + "\n" for r in records), mode="w", suffix=".jsonl")


def read_json(path: str | os.PathLike) -> Any:
    """Reads a JSON file, or raises a ``ConfigError`` that names it (missing, unreadable or not JSON)."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise errors.ConfigError(f"{path} does not exist.") from None
    except (OSError, ValueError) as e:
        raise errors.ConfigError(f"{path} is not readable JSON ({type(e).__name__}: {e}"[:300] + ").") from None


def load(path: str | os.PathLike, template: Any) -> tuple[Any, dict[str, np.ndarray], dict[str, Any]]:
    """Reads a checkpoint written by :func:`save` into the structure of ``template``.

    Returns:
      ``(state, arrays, header)``.

    Raises:
      ConfigError: when the file is not a readable checkpoint (cut short, empty, corrupted, not ours), or does not fit
        the template (another model, worker count or rule).
    """
    header, leaves, arrays = _read(os.fspath(path))
    template_leaves, treedef = jax.tree.flatten(template)
    if len(leaves) != len(template_leaves):
        raise errors.ConfigError(
            f"Checkpoint {path} holds {len(leaves)} arrays but this run's state has {len(template_leaves)}: it was "
            "written by a different configuration. Use another checkpoint_dir or delete the old checkpoint."
        )
    for i, (got, want) in enumerate(zip(leaves, template_leaves, strict=True)):
        # The template may be abstract (jax.ShapeDtypeStruct, from jax.eval_shape): read its shape and dtype alone.
        shape = tuple(getattr(want, "shape", np.shape(want)))
        dtype = np.dtype(want.dtype) if hasattr(want, "dtype") else np.asarray(want).dtype
        got = leaves[i] = _typed(got, dtype)
        if got.shape != shape or got.dtype != dtype:
            raise errors.ConfigError(
                f"Checkpoint {path} leaf {i} is {got.dtype}{list(got.shape)} but this run needs "
                f"{dtype}{list(shape)}: it was written by a different configuration."
            )
    return jax.tree.unflatten(treedef, leaves), arrays, header


def _typed(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A leaf of a checkpoint from before the dtypes were recorded, in the template's dtype where ``.npz`` kept only
    its bytes: a bfloat16 leaf was stored as ``|V2`` (the only 2-byte dtype of ml_dtypes; a 1-byte one's raw bytes
    could be any of a dozen, and stay refused). The same bytes, a view."""
    raw = array.dtype.kind == "V" and array.dtype.fields is None and array.dtype.itemsize == 2
    return array.view(dtype) if raw and dtype.kind == "V" and dtype.itemsize == 2 else array


def _storable(x: np.ndarray) -> np.ndarray:
    """``x`` as ``.npz`` stores faithfully: as it is, or (a dtype NumPy does not know) its bytes as unsigned ints."""
    return x if x.dtype.isbuiltin == 1 or x.dtype.fields is not None else x.view(f"u{x.dtype.itemsize}")


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's JSON header (the file is read whole, so damage shows here as a ``ConfigError``)."""
    return _read(os.fspath(path))[0]


def _read(path: str) -> tuple[dict[str, Any], list[np.ndarray], dict[str, np.ndarray]]:
    """The header, leaves and arrays of a checkpoint file, every array read now (so damage shows here)."""
    damaged = (
        f"{path} is not a readable checkpoint ({{}}): it was cut short or corrupted (a full disk, a copy "
        "that did not finish). Restore it from a copy, or move it aside to start afresh."
    )
    try:
        with np.load(path, allow_pickle=False) as f:
            if _HEADER not in f.files:
                raise errors.ConfigError(damaged.format("no asgd_jax header"))
            header = json.loads(bytes(f[_HEADER]).decode())
            leaves = [f[k] for k in sorted(k for k in f.files if k.startswith("leaf_"))]
            if _DTYPES in f.files:  # (a leaf stored as unsigned integers: in its own dtype again)
                names = json.loads(bytes(f[_DTYPES]).decode())
                leaves = [x if str(x.dtype) == n else x.view(np.dtype(n)) for x, n in zip(leaves, names, strict=True)]
            arrays = {k[len("array_") :]: f[k] for k in f.files if k.startswith("array_")}
    except errors.ConfigError:
        raise
    except FileNotFoundError:
        raise errors.ConfigError(f"{path} does not exist.") from None
    except (
        OSError,
        ValueError,
        TypeError,
        EOFError,
        KeyError,
        zipfile.BadZipFile,
        zlib.error,
        UnicodeDecodeError,
    ) as e:
        raise errors.ConfigError(damaged.format(f"{type(e).__name__}: {e}"[:200])) from None
    if not isinstance(header, dict):
        raise errors.ConfigError(damaged.format("its header is not a JSON object"))
    return header, leaves, arrays


def save_model(path: str | os.PathLike, params: Any, model_state: Any = None) -> None:
    """Writes a model's weights (and model state) atomically: what a warm start loads."""
    save(path, {"params": params, "model_state": model_state or {}}, {}, {"kind": "model"})


def load_model(path: str | os.PathLike, params: Any, model_state: Any = None) -> tuple[Any, Any]:
    """Reads :func:`save_model`'s file (or the ``model.npz`` in a run folder) into the structure of a freshly
    initialised ``params`` / ``model_state``; returns ``(params, model_state)``.

    Raises:
      ValueError: when there is no such file, or it holds another model.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "model.npz")
    if not os.path.exists(path):
        raise errors.ConfigError(f"No saved model at {path}: give a model.npz, or a run folder of asgd-jax train.")
    state, _, header = load(path, {"params": params, "model_state": model_state or {}})
    if header.get("kind") != "model":
        raise errors.ConfigError(f"{path} is not a saved model (kind={header.get('kind')!r}): give a run's model.npz.")
    return state["params"], (state["model_state"] if model_state is not None else None)


class Writer:
    """Writes checkpoints on a thread of its own, so the caller never waits for the disk.

    :meth:`submit` hands over a consistent snapshot (already on the host); a newer one supersedes one not yet written.
    A failing write (a full disk) calls ``on_error(OSError)`` and leaves the previous checkpoint on disk: the last good
    one.

    Args:
      path: the checkpoint file.
      on_error: called with the error of a failed write.
    """

    def __init__(self, path: str | os.PathLike, on_error: Callable[[OSError], None]):
        self.path, self._on_error = os.fspath(path), on_error
        self._pending: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="checkpoint-writer")
        self._thread.start()

    def submit(self, state: Any, arrays: dict[str, np.ndarray], header: dict[str, Any]) -> None:
        """Queues a checkpoint (dropping a pending older one: the newer supersedes it)."""
        while True:
            try:
                self._pending.put_nowait((state, arrays, header))
                return
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self._pending.get_nowait()
                    self._pending.task_done()  # (superseded)

    def _loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                save(self.path, *item)
            except Exception as e:  # a full disk: stop now, while the previous checkpoint is still the latest
                why = f"writing the checkpoint {self.path} failed ({e}); the previous one stays valid"
                self._on_error(OSError(why))
            finally:
                self._pending.task_done()  # (what flush waits for)

    def flush(self, timeout: float = 60.0) -> None:
        """Waits (up to ``timeout`` seconds) until the checkpoint being written and the one pending are on disk, or
        failed: what is on disk is then what a message about it may say."""
        if not self._thread.is_alive() or threading.current_thread() is self._thread:
            return
        done = self._pending.all_tasks_done
        with done:
            done.wait_for(lambda: self._pending.unfinished_tasks == 0, timeout)

    def close(self, timeout: float = 600.0) -> None:
        """Writes what is pending, then stops."""
        if self._thread.is_alive():
            self._pending.put(None)
            self._thread.join(timeout=timeout)
