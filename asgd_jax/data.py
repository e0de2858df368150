"""Datasets by name: the embedded ones need no network; TFDS ones are read from a prepared ``data_dir``.

``load("digits")`` is scikit-learn's bundled 8x8 digits (1,797 images); ``load("mnist1d")`` is MNIST-1D (Greydanus
2020) generated offline by its own ``make_dataset`` with the reference arguments (the download path is never taken).
``load("tfds:cifar10")`` (also ``tfds:mnist``, ``tfds:fashion_mnist``, any ``tfds:<name>[:<config>]`` of fixed-size
images) reads a dataset that ``asgd-jax data prepare <name> --data-dir DIR`` prepared once, through
``tfds.data_source`` (random access on array_record files, no TensorFlow needed). Nothing is ever downloaded
implicitly: an unprepared dataset fails within seconds with the command that prepares it.

Every image or signal dataset comes back as a :class:`Dataset` of float32 inputs with a channel axis (standardised
per channel with training-split statistics) and int32 labels. ``load("grammar")`` is a language-modelling task made
offline: character windows of sentences drawn from a small probabilistic grammar of English (:func:`grammar_text`),
int32 character ids in and the next character of every position as the labels ``[n, length]``; a model's loss and
error are then per character, and ``exp(loss)`` its perplexity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import os
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np

from asgd_jax import cache, errors

__all__ = [
    "EMBEDDED",
    "GRAMMAR_ALPHABET",
    "TEXT_WINDOW",
    "Dataset",
    "DatasetNotPrepared",
    "check_network",
    "clear_cache",
    "grammar_text",
    "load",
    "prepare",
    "tfds_source",
]

TFDS_DOCUMENTED = ("cifar10", "mnist", "fashion_mnist", "imagenet2012")


class DatasetNotPrepared(errors.ConfigError):
    """A TFDS dataset is not prepared in the data directory; the message gives the command that prepares it."""


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A classification dataset held in host memory.

    Attributes:
      name: the name it was loaded by.
      x_train, y_train: training inputs ``[n, *input_shape]`` (float32; int32 token ids for a language task) and
        labels ``[n]`` (int32; ``[n, length]``, the next token of every position, for a language task).
      x_test, y_test: held-out inputs and labels.
      num_classes: number of classes.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input example, channels last."""
        return tuple(self.x_train.shape[1:])

    @property
    def train(self) -> dict[str, np.ndarray]:
        """The training split as the ``{"x", "y"}`` pytree the simulator takes."""
        return {"x": self.x_train, "y": self.y_train}

    @property
    def test(self) -> dict[str, np.ndarray]:
        """The test split as a ``{"x", "y"}`` pytree."""
        return {"x": self.x_test, "y": self.y_test}

    def __repr__(self) -> str:
        return (
            f"Dataset({self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
            f"input_shape={self.input_shape}, num_classes={self.num_classes})"
        )


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int):
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def _standardise(x_train: np.ndarray, x_test: np.ndarray):
    # Per-channel statistics of the training split only, so the test split stays unseen.
    axes = tuple(range(x_train.ndim - 1))
    mean = x_train.mean(axis=axes, keepdims=True)
    std = x_train.std(axis=axes, keepdims=True) + 1e-8
    return ((x_train - mean) / std).astype(np.float32), ((x_test - mean) / std).astype(np.float32)


@functools.cache
def _digits(seed: int) -> Dataset:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    bunch = load_digits()
    x = bunch.images.astype(np.float64)[..., None]  # [1797, 8, 8, 1]
    y = bunch.target.astype(np.int32)
    x_tr, y_tr, x_te, y_te = _split(x, y, test_fraction=0.2, seed=seed)
    x_tr, x_te = _standardise(x_tr, x_te)
    return Dataset("digits", x_tr, y_tr, x_te, y_te, num_classes=10)


_MNIST1D_ARRAYS = ("x", "y", "x_test", "y_test")


def _checksum(arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}{a.dtype.str}{a.shape}".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


def _read_kept(path: str, names: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    """The arrays kept in ``path``, or None when it is missing, unreadable or does not match its checksum."""
    try:
        with np.load(path, allow_pickle=False) as kept:
            arrays = {n: kept[n] for n in names}
            ok = str(kept["checksum"]) == _checksum(arrays)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    return arrays if ok else None


def _keep(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Writes ``arrays`` to ``path`` with their checksum, atomically; a folder that cannot be written (read-only, disk
    full) keeps nothing, and the caller regenerates next time."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            contents: dict[str, Any] = {"checksum": np.asarray(_checksum(arrays)), **arrays}
            np.savez(f, **contents)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _generate_mnist1d(seed: int) -> dict[str, np.ndarray]:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.seed = 42 + seed  # 42 is the reference dataset
    # make_dataset seeds NumPy's global generator; leave the caller's global state as it was.
    saved = np.random.get_state()  # noqa: NPY002 (mnist1d seeds the legacy global generator)
    try:
        raw = make_dataset(args)
    finally:
        np.random.set_state(saved)  # noqa: NPY002
    return {n: np.asarray(raw[n]) for n in _MNIST1D_ARRAYS}


@functools.cache
def _mnist1d(seed: int) -> Dataset:
    # Generating takes ~3 s on two cores: kept on disk (see asgd_jax.cache.data_folder), keyed by the generator's
    # version and NumPy's, checked against its checksum on every read.
    folder = cache.data_folder()
    raw = None
    if folder is not None:
        version = f"{importlib.metadata.version('mnist1d')}-np{np.__version__}"
        path = os.path.join(folder, f"mnist1d-seed{seed}-{version}.npz")
        raw = _read_kept(path, _MNIST1D_ARRAYS)
    if raw is None:
        raw = _generate_mnist1d(seed)
        if folder is not None:
            _keep(path, raw)
    x_tr, x_te = _standardise(raw["x"][..., None], raw["x_test"][..., None])
    return Dataset(
        "mnist1d",
        x_tr,
        raw["y"].astype(np.int32),
        x_te,
        raw["y_test"].astype(np.int32),
        num_classes=10,
    )


def _words(spec: str) -> list[tuple[float, tuple[str, ...]]]:
    """``"cat:5 dog:4"`` as a grammar rule's weighted one-word expansions."""
    return [(float(w), (word,)) for word, w in (item.split(":") for item in spec.split())]


# A probabilistic grammar of simple English sentences: nonterminal -> [(weight, expansion)], lower-case words.
_GRAMMAR: dict[str, list[tuple[float, tuple[str, ...]]]] = {
    "S": [(0.7, ("NP", "VP")), (0.2, ("NP", "VP", "CONJ", "NP", "VP")), (0.1, ("ADV", "NP", "VP"))],
    "NP": [(0.45, ("DET", "N")), (0.25, ("DET", "ADJ", "N")), (0.15, ("DET", "N", "PP")), (0.15, ("NAME",))],
    "VP": [(0.45, ("V", "NP")), (0.2, ("V",)), (0.2, ("V", "NP", "PP")), (0.15, ("V", "ADV"))],
    "PP": [(1.0, ("P", "NP"))],
    "DET": [(0.4, ("the",)), (0.25, ("a",)), (0.15, ("every",)), (0.1, ("some",)), (0.1, ("no",))],
    "N": _words("cat:5 dog:4 bird:3 child:3 teacher:2 river:2 garden:2 house:1 song:1 letter:1"),
    "ADJ": _words("small:1 old:1 bright:1 quiet:1 red:1 happy:1"),
    "V": _words("sees:4 likes:3 finds:3 chases:2 writes:2 sings:1 builds:1 remembers:1"),
    "P": _words("near:1 under:1 behind:1 with:1"),
    "NAME": _words("alice:1 bob:1 carol:1"),
    "ADV": _words("often:1 rarely:1 quietly:1 today:1"),
    "CONJ": [(0.6, ("and",)), (0.4, ("but",))],
}
TEXT_WINDOW = 64  # characters per example of a text corpus (the grammar's too)
GRAMMAR_ALPHABET = " .abcdefghijklmnopqrstuvwxyz"  # index 0 is the space


def grammar_text(num_chars: int, seed: int) -> str:
    """At least ``num_chars`` characters of sentences drawn from the grammar with NumPy's generator ``seed``."""
    rng = np.random.default_rng(seed)
    choices = {k: (np.cumsum([w for w, _ in v]) / sum(w for w, _ in v), [e for _, e in v]) for k, v in _GRAMMAR.items()}
    words: list[str] = []
    length = -1  # the joined text's: each sentence adds itself and the space before it
    while length < num_chars:
        stack = ["S"]
        sentence: list[str] = []
        while stack:
            symbol = stack.pop()
            if symbol not in choices:
                sentence.append(symbol)
                continue
            cdf, expansions = choices[symbol]
            stack.extend(reversed(expansions[int(np.searchsorted(cdf, rng.random(), side="right"))]))
        words.append(" ".join(sentence) + ".")
        length += len(words[-1]) + 1
    return " ".join(words)


@functools.cache
def _grammar(seed: int, seq_len: int = TEXT_WINDOW, train: int = 4096, test: int = 512) -> Dataset:
    """Sequences of ``seq_len`` characters cut from a stream of grammar sentences, the target the next character."""
    table = np.full(128, -1, np.int32)
    table[[ord(c) for c in GRAMMAR_ALPHABET]] = np.arange(len(GRAMMAR_ALPHABET))

    def windows(count: int, stream_seed: int):
        text = grammar_text(count * seq_len + 1, stream_seed)
        ids = table[np.frombuffer(text.encode("ascii"), np.uint8)][: count * seq_len + 1]
        x = ids[:-1].reshape(count, seq_len)
        y = ids[1:].reshape(count, seq_len)
        return x, y

    x_tr, y_tr = windows(train, 2 * seed)
    x_te, y_te = windows(test, 2 * seed + 1)
    return Dataset("grammar", x_tr, y_tr, x_te, y_te, num_classes=len(GRAMMAR_ALPHABET))


EMBEDDED: dict[str, Callable[[int], Dataset]] = {"digits": _digits, "mnist1d": _mnist1d, "grammar": _grammar}
"""The datasets that ship with the install and need no network."""


def _parse_tfds(name: str) -> tuple[str, str | None]:
    parts = name.split(":")
    if len(parts) not in (2, 3) or not parts[1]:
        raise errors.ConfigError(f"Dataset name {name!r} is invalid: use 'tfds:<name>' or 'tfds:<name>:<config>'.")
    return parts[1], (parts[2] if len(parts) == 3 and parts[2] else None)


def _tfds():
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise errors.MissingDependency(
            "TFDS datasets need tensorflow-datasets: pip install 'asgd_jax[tfds]' (or: pip install "
            "tensorflow-datasets importlib_resources)."
        ) from None
    return tfds


def _default_data_dir(data_dir: str | os.PathLike | None) -> str:
    return os.fspath(data_dir or os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets"))


def _require_prepared(builder, name: str, data_dir: str) -> None:
    """Fails fast (no network, no TFDS retry loop) when ``builder`` has no prepared files."""
    if not os.path.exists(os.path.join(builder.data_dir, "dataset_info.json")):
        raise DatasetNotPrepared(
            f"Dataset {name!r} is not prepared: looked for {builder.data_dir}/dataset_info.json. Prepare it once "
            f"(needs network access; ImageNet also needs --manual-dir with the downloaded archives):\n"
            f"    asgd-jax data prepare {name} --data-dir {data_dir}"
        )


def tfds_source(name: str, split: str, *, data_dir: str | os.PathLike | None = None):
    """A random-access source (``len`` and ``source[i] -> dict``) over a prepared TFDS split; never downloads.

    Args:
      name: ``"tfds:<name>[:<config>]"``.
      split: a TFDS split, e.g. ``"train"`` or ``"test[:10%]"``.
      data_dir: where the dataset was prepared (default ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).

    Returns:
      ``(source, builder_info)``.

    Raises:
      DatasetNotPrepared: with the ``asgd-jax data prepare`` command to run.
    """
    tfds = _tfds()
    ds_name, config = _parse_tfds(name)
    data_dir = _default_data_dir(data_dir)
    full = ds_name if config is None else f"{ds_name}/{config}"
    builder = _builder(tfds, full, data_dir)
    _require_prepared(builder, name, data_dir)
    source = tfds.data_source(full, split=split, data_dir=data_dir, download=False)
    return source, builder.info


def _builder(tfds, full: str, data_dir: str):
    """TFDS's builder of ``full``, or a one-line error with the closest names (TFDS's own lists every dataset)."""
    try:
        return tfds.builder(full, data_dir=data_dir)
    except Exception:
        import difflib

        try:
            with contextlib.redirect_stdout(io.StringIO()):  # TFDS prints a banner when TensorFlow is missing
                names = tfds.list_builders()
        except Exception:  # listing needs TensorFlow in some TFDS versions
            names = list(TFDS_DOCUMENTED)
        close = difflib.get_close_matches(full.split("/")[0], names, n=5)
        hint = f": did you mean {', '.join(close)}?" if close else "."
        raise errors.ConfigError(
            f"TFDS has no dataset {full!r}{hint} The catalog: https://www.tensorflow.org/datasets/catalog"
        ) from None


def _records(source) -> list:
    n = len(source)
    try:
        return list(source.__getitems__(list(range(n))))
    except Exception:  # sources without batched reads (e.g. TFDS's mocks)
        return [source[i] for i in range(n)]


def _read_texts(source) -> str:
    """A text split's examples joined by newlines (bytes read as UTF-8)."""
    texts = (r["text"] for r in _records(source))
    return "\n".join(t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t) for t in texts)


def _text_dataset(name: str, train: str, test: str, seq_len: int = TEXT_WINDOW) -> Dataset:
    """A corpus as language modelling per character: windows of ``seq_len`` character ids cut from each split, the
    label of every position the next character; the alphabet is the training split's characters, sorted, and one id
    more for a character only the test split holds."""
    alphabet = sorted(set(train))
    ids = {c: i for i, c in enumerate(alphabet)}

    def windows(text: str, split: str):
        count = (len(text) - 1) // seq_len
        errors.require(
            count >= 1, "dataset", name, f"its {split} split has {len(text)} characters: fewer than one window of "
            f"{seq_len + 1}"
        )  # fmt: skip
        stream = np.fromiter((ids.get(c, len(alphabet)) for c in text[: count * seq_len + 1]), np.int32)
        return stream[:-1].reshape(count, seq_len), stream[1:].reshape(count, seq_len)

    x_tr, y_tr = windows(train, "training")
    x_te, y_te = windows(test, "test")
    return Dataset(name, x_tr, y_tr, x_te, y_te, num_classes=len(alphabet) + 1)


def _read_all(source, image_key: str, label_key: str) -> tuple[np.ndarray, np.ndarray]:
    records = _records(source)
    x = np.stack([np.asarray(r[image_key]) for r in records])
    y = np.asarray([int(r[label_key]) for r in records], np.int32)
    return x, y


@functools.cache
def _tfds_dataset(name: str, data_dir: str, train_split: str, test_split: str) -> Dataset:
    train, info = tfds_source(name, train_split, data_dir=data_dir)
    test, _ = tfds_source(name, test_split, data_dir=data_dir)
    features = info.features
    if set(features) == {"text"}:  # a text corpus (tiny_shakespeare, lm1b, ...): language modelling per character
        return _text_dataset(name, _read_texts(train), _read_texts(test))
    image_key = "image" if "image" in features else next(iter(features))
    label_key = "label" if "label" in features else list(features)[-1]
    shape = getattr(features[image_key], "shape", None)
    if shape is None or None in tuple(shape):
        raise errors.ConfigError(
            f"{name!r} has images of varying size {shape}: load() keeps datasets in memory and needs a fixed shape. "
            "Stream it instead (the trainer's host-side iterator)."
        )
    x_tr, y_tr = _read_all(train, image_key, label_key)
    x_te, y_te = _read_all(test, image_key, label_key)
    x_tr, x_te = _standardise(x_tr.astype(np.float64), x_te.astype(np.float64))
    num_classes = int(getattr(features[label_key], "num_classes", int(max(y_tr.max(), y_te.max())) + 1))
    return Dataset(name, x_tr, y_tr, x_te, y_te, num_classes=num_classes)


def clear_cache() -> None:
    """Forgets every dataset :func:`load` has cached, so the next call reads (or generates) it afresh."""
    for cached in (_digits, _mnist1d, _grammar, _tfds_dataset):
        cached.cache_clear()


def load(
    name: str,
    *,
    seed: int = 0,
    data_dir: str | os.PathLike | None = None,
    train_split: str = "train",
    test_split: str = "test",
) -> Dataset:
    """Loads a dataset by name, fully into host memory.

    Args:
      name: ``"digits"`` (8x8 images, 1,438 train / 359 test), ``"mnist1d"`` (length-40 signals, 4,000 / 1,000),
        ``"grammar"`` (language modelling: 64-character windows of sentences from a probabilistic grammar, the label
        of each position the next character; 4,096 / 512, a vocabulary of 28), or
        ``"tfds:<name>[:<config>]"`` for a prepared TFDS dataset of fixed-size images (``tfds:cifar10``,
        ``tfds:mnist``, ``tfds:fashion_mnist``) or of text (``tfds:tiny_shakespeare``, ``tfds:lm1b``: a dataset
        whose one feature is ``text`` becomes language modelling per character, as ``"grammar"``: windows of
        :data:`TEXT_WINDOW` character ids, the next character the label, the training split's characters the
        alphabet).
      seed: selects the train/test split (digits) or the generated sample (mnist1d); 0 is the reference.
      data_dir: TFDS only: where the dataset was prepared (default ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
      train_split, test_split: TFDS only: the splits to read.

    Returns:
      A :class:`Dataset`; repeated calls return the same cached object.

    Raises:
      DatasetNotPrepared: a TFDS dataset that was not prepared (the message says how).

    Example:
      >>> import asgd_jax
      >>> ds = asgd_jax.data.load("digits")
      >>> ds.x_train.shape, ds.x_test.shape, ds.num_classes
      ((1438, 8, 8, 1), (359, 8, 8, 1), 10)
    """
    errors.require(
        isinstance(name, str), "dataset", name, f"give a dataset name: {', '.join(sorted(EMBEDDED))} or tfds:<name>"
    )
    if name.startswith("tfds:"):
        return _tfds_dataset(name, _default_data_dir(data_dir), train_split, test_split)
    if name not in EMBEDDED:
        known = ", ".join(sorted(EMBEDDED))
        raise errors.ConfigError(
            f"Unknown dataset {name!r}. Embedded datasets: {known}; TFDS datasets: 'tfds:<name>' (e.g. "
            f"{', '.join('tfds:' + n for n in TFDS_DOCUMENTED)})."
        )
    if not isinstance(seed, int) or seed < 0:
        raise errors.ConfigError(f"seed={seed!r} is invalid: use a non-negative int.")
    return EMBEDDED[name](seed)


def prepare(
    name: str, *, data_dir: str | os.PathLike | None = None, manual_dir: str | os.PathLike | None = None
) -> str:
    """Downloads and prepares a TFDS dataset once, as array_record files (TFDS's own download_and_prepare).

    This is the only function in asgd_jax that downloads. ImageNet (``imagenet2012``) needs the archives downloaded
    by hand into ``manual_dir`` first. Some TFDS builders need TensorFlow installed to prepare (not to read).

    Returns:
      The folder the dataset was written to.
    """
    errors.require(isinstance(name, str) and name.strip() != "", "name", name, "give a TFDS name, e.g. 'mnist'")
    ds_name, config = _parse_tfds(name if name.startswith("tfds:") else f"tfds:{name}")
    full = ds_name if config is None else f"{ds_name}/{config}"
    data_dir = errors.output_folder("data_dir", _default_data_dir(data_dir), "--data-dir")
    if manual_dir is None:  # a manual download needs no network for its archives
        check_network(full, data_dir)
    tfds = _tfds()
    builder = _builder(tfds, full, data_dir)
    download_config = tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir) if manual_dir else None)
    builder.download_and_prepare(file_format="array_record", download_config=download_config)
    return builder.data_dir


# TFDS asks its storage bucket for a prepared copy of every dataset first: if that host does not answer within seconds,
# TFDS's own retries would take minutes to say so.
NETWORK_PROBE = ("storage.googleapis.com", 443)


def check_network(name: str, data_dir: str, timeout: float = 5.0) -> None:
    """Fails within ``timeout`` seconds, with what to do offline, when the host TFDS downloads from cannot be reached.

    Raises:
      ConfigError: naming the dataset, the host and the way to prepare it offline.
    """
    import socket

    try:
        socket.create_connection(NETWORK_PROBE, timeout=timeout).close()
    except OSError as e:
        raise errors.ConfigError(
            f"preparing {name!r} downloads it, but this machine cannot reach the network ({NETWORK_PROBE[0]}: "
            f"{e.strerror or type(e).__name__}). Offline: run `asgd-jax data prepare {name} --data-dir DIR` on a "
            f"machine with network, copy DIR here and pass --data-dir DIR (now {data_dir}); the embedded datasets "
            "(digits, mnist1d) need no download."
        ) from None
