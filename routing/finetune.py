"""Fine-tuning the routing encoder on labelled texts (a published global's scenarios, its tool
descriptions, public probe requests): the sentence-transformers model learns to tell the tools
apart through a linear layer over its normalized embedding, started from the logistic regression
the router's head fits (`routing.router.HEAD_C`). The result is a sentence-transformers model
directory that any engine setting taking a model path loads (`get_engine(path)`).

Measured in `bench/finetune_router.py` (see `bench/results/EXPERIMENTS.md`): one epoch on
MetaTool globals lifts top-1 by 1.5 ± 0.5 points over the frozen model. Pure: no Django."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def fine_tune_encoder(
    texts: Sequence[str],
    labels: Sequence[str],
    out_dir: str | Path,
    *,
    base_model: str | None = None,
    epochs: int = 1,
    seed: int = 0,
    batch_size: int = 32,
    encoder_lr: float = 3e-5,
    layer_lr: float = 1e-3,
) -> Path:
    """Fine-tune `base_model` (a sentence-transformers path; default: the bundled MiniLM, fp32)
    to tell `labels` apart from `texts` (one label per text), `epochs` passes in seeded order, and
    save it to `out_dir`. Texts are read as given: strip masking placeholders beforehand, as the
    engine does. Raises ValueError on texts and labels of different lengths, fewer than two
    labels, or fewer than one epoch."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from sklearn.linear_model import LogisticRegression

    from routing.embeddings import DEFAULT_MODEL, _resolve
    from routing.router import HEAD_C

    if len(texts) != len(labels):
        raise ValueError(f"{len(texts)} texts for {len(labels)} labels")
    classes = sorted(set(labels))
    if len(classes) < 2:
        raise ValueError("fine-tuning needs texts of at least two labels")
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, not {epochs}")
    position = {label: i for i, label in enumerate(classes)}
    texts = list(texts)
    y = torch.tensor([position[label] for label in labels])

    torch.manual_seed(seed)
    model = SentenceTransformer(_resolve(base_model or DEFAULT_MODEL), device="cpu")
    model.eval()
    with torch.no_grad():
        frozen = model.encode(texts, batch_size=64, normalize_embeddings=True)
    start = LogisticRegression(C=HEAD_C, max_iter=1000).fit(frozen, y.numpy())
    layer = torch.nn.Linear(frozen.shape[1], len(classes))
    with torch.no_grad():
        coef = np.asarray(start.coef_, dtype=np.float32)
        intercept = np.asarray(start.intercept_, dtype=np.float32)
        if len(classes) == 2:  # sklearn's binary form: one logit for class 1 against class 0 at 0
            coef = np.vstack([np.zeros_like(coef), coef])
            intercept = np.concatenate([np.zeros_like(intercept), intercept])
        layer.weight.copy_(torch.from_numpy(coef))
        layer.bias.copy_(torch.from_numpy(intercept))
    optimizer = torch.optim.AdamW(
        [{"params": model.parameters(), "lr": encoder_lr}, {"params": layer.parameters(), "lr": layer_lr}],
        weight_decay=0.01,
    )
    order = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        permutation = torch.randperm(len(texts), generator=order)
        for first in range(0, len(texts), batch_size):
            batch = permutation[first : first + batch_size]
            pooled = model(model.preprocess([texts[i] for i in batch]))["sentence_embedding"]
            logits = layer(torch.nn.functional.normalize(pooled, dim=-1))
            loss = torch.nn.functional.cross_entropy(logits, y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    out = Path(out_dir)
    model.save(str(out))
    return out
