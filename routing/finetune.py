"""Fine-tuning the routing encoder on labelled texts (a published global's scenarios, its tool
descriptions, public probe requests): the sentence-transformers model learns to tell the tools
apart through a linear layer over its normalized embedding, started from the logistic regression
the router's head fits (`routing.router.HEAD_C`). The result is a sentence-transformers model
directory that any engine setting taking a model path loads (`get_engine(path)`).

`tune_router` is the whole step the server runs after publishing a global (`federation.tuning`) and
`manage.py simulate --tune-router` runs after each simulated round: fine-tune on the global's
scenarios, its descriptions and the half of the public probe set the head learns from
(`tuning_rows`), re-embed the global with the tuned model, refit the router on the probe
(`routing.router.fit_router`: head on the whole probe, fusion weights and calibration on the half
the encoder never saw), and save it all in one folder that `load_tuned_router` reads back.

Measured in `bench/finetune_router.py` (see `bench/results/EXPERIMENTS.md`): one epoch on
MetaTool globals lifts top-1 by 1.5 ± 0.5 points over the frozen model. Pure: no Django."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from compendium.masking import without_placeholders
from compendium.schema import Compendium

ROUTER_STATE = "synapse-router.npz"  # beside the model: scenario/precaution vectors, head
ROUTER_PARAMS = "synapse-router-params.json"
# What the folder holds, file by file (relative path, size, sha256), with the digest of the
# compendium rows its vectors are aligned with: what the server publishes for clients to download
# the tuned router (GET /api/v1/compendium/global/router/) and what they check it against.
ROUTER_MANIFEST = "synapse-router-manifest.json"
MANIFEST_FORMAT = 1
# Lossless deltas of the tuned weights against the base model's (`routing.weights_delta`): a
# client that holds the same base (the bundled MiniLM) downloads about 40 MB instead of 91.
DELTA_DIR = "deltas"
DELTA_BASES = "bases.json"  # in DELTA_DIR: target path -> sha256 of the base file it needs


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
    device: str | None = None,
) -> Path:
    """Fine-tune `base_model` (a sentence-transformers path; default: the bundled MiniLM, fp32)
    to tell `labels` apart from `texts` (one label per text), `epochs` passes in seeded order, and
    save it to `out_dir`. Texts are read as given: strip masking placeholders beforehand, as the
    engine does. Raises ValueError on texts and labels of different lengths, fewer than two
    labels, or fewer than one epoch. `device`: a torch device (default: CUDA where there is
    one, else the CPU); the saved model loads anywhere."""
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
    device = device or default_device()
    model = SentenceTransformer(_resolve(base_model or DEFAULT_MODEL), device=device)
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
    layer.to(model.device)
    y = y.to(model.device)
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
            features = model.preprocess([texts[i] for i in batch])
            features = {k: v.to(model.device) if hasattr(v, "to") else v for k, v in features.items()}
            pooled = model(features)["sentence_embedding"]
            logits = layer(torch.nn.functional.normalize(pooled, dim=-1))
            loss = torch.nn.functional.cross_entropy(logits, y[batch.to(model.device)])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    out = Path(out_dir)
    model.save(str(out))
    return out


def tuning_rows(
    compendium: Compendium, examples: Sequence[tuple[str, str]] = ()
) -> tuple[list[str], list[str]]:
    """What the encoder learns from, as (texts, tool ids): every scenario of `compendium` (as the
    engine reads it, without masking placeholders), the labelled `examples` ((request, tool id),
    public probe requests) and the description of every tool of either: the tools the router's
    head ranks (`routing.router.head_tools`)."""
    texts = [without_placeholders(s.text) for s in compendium.scenarios]
    labels = [s.tool_id for s in compendium.scenarios]
    tools = set(labels) | {tool for _, tool in examples}
    for meta in compendium.metadata:
        if meta.description and meta.tool_id in tools:
            texts.append(meta.description)
            labels.append(meta.tool_id)
    for text, tool in examples:
        texts.append(text)
        labels.append(tool)
    return texts, labels


@dataclass
class TunedRouter:
    directory: Path
    router: object  # routing.router.Router, fusion reranker, with the tuned engine
    rows: int  # texts the encoder was tuned on
    seconds: float  # fine-tuning, re-embedding and refitting
    fine_tune_seconds: float = 0.0  # of which the fine-tuning itself (on `device`)
    device: str = ""  # where it was fine-tuned, as `torch_device_name` says it


def tune_router(
    compendium: Compendium,
    probe: Sequence[tuple[str, str]],
    out_dir: str | Path,
    *,
    epochs: int = 1,
    seed: int = 0,
    base_model: str | None = None,
    fit_limit: int | None = 1000,
    device: str | None = None,
    manifest: dict | None = None,
) -> TunedRouter:
    """Fine-tune the encoder on `compendium` and the learn half of the public `probe` ((request,
    tool id) pairs; `routing.router.probe_halves`), then build the router that routes with it
    (`routing.router.fit_router`: its fusion weights are fitted on the half the encoder never
    saw) and save model, vectors, head and weights in `out_dir`, with their manifest
    (`write_manifest`; `manifest`: fields it records beside the files). Raises ValueError when the
    compendium's scenarios and the probe's requests name fewer than two tools."""
    from routing.embeddings import EmbeddingEngine
    from routing.router import fit_router, probe_halves

    started = time.perf_counter()
    probe = list(probe)
    learn, _ = probe_halves(len(probe))
    texts, labels = tuning_rows(compendium, [probe[i] for i in learn])
    out = fine_tune_encoder(
        texts, labels, out_dir, base_model=base_model, epochs=epochs, seed=seed, device=device
    )
    fine_tuned = time.perf_counter() - started
    write_weight_deltas(out, base_model)
    engine = EmbeddingEngine(str(out))
    scenario_vectors, precaution_vectors = embed_rows(engine, compendium)
    router = fit_router(
        compendium, engine, probe, fit_limit=fit_limit,
        scenario_embeddings=scenario_vectors, precaution_embeddings=precaution_vectors,
        fitted_on="probe set, the half the tuned encoder did not learn from",
    )
    state = {"scenarios": scenario_vectors, "precautions": precaution_vectors}
    if router.head is not None:
        state["head"] = np.frombuffer(router.head.to_bytes(), dtype=np.uint8)
    np.savez(out / ROUTER_STATE, **state)
    (out / ROUTER_PARAMS).write_text(router.params.to_json())
    write_manifest(out, compendium, **(manifest or {}))
    return TunedRouter(
        out, router, len(texts), time.perf_counter() - started, fine_tuned, torch_device_name(device)
    )


def default_device() -> str:
    """The torch device fine-tuning runs on when none is named: CUDA where torch sees one (a
    CUDA build of torch and a GPU), else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def torch_device_name(device: str | None = None) -> str:
    """`device` (default: `default_device()`) as an operator reads it: "cuda:0 (NVIDIA H100 80GB
    HBM3)" or "cpu"."""
    import torch

    device = torch.device(device or default_device())
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def embed_rows(engine, compendium: Compendium) -> tuple[np.ndarray, np.ndarray]:
    """The compendium's scenario and precaution vectors by `engine`, row-aligned."""
    scenarios = engine.embed([s.text for s in compendium.scenarios])
    precautions = (
        engine.embed([p.text for p in compendium.precautions])
        if compendium.precautions
        else np.zeros((0, engine.dimension), dtype=np.float32)
    )
    return scenarios, precautions


@dataclass
class LoadedTunedRouter:
    engine: object  # routing.embeddings.EmbeddingEngine over the tuned model
    scenario_embeddings: np.ndarray  # row-aligned with the compendium's scenarios
    precaution_embeddings: np.ndarray  # row-aligned with the compendium's precautions
    head: object | None  # routing.router.LinearHead
    params: object  # routing.router.RoutingParams


def load_tuned_router(directory: str | Path) -> LoadedTunedRouter:
    """What `tune_router` saved in `directory`. Raises FileNotFoundError when it is not there."""
    from routing.embeddings import EmbeddingEngine
    from routing.router import LinearHead, RoutingParams

    directory = Path(directory)
    with np.load(directory / ROUTER_STATE, allow_pickle=False) as state:
        scenarios = np.asarray(state["scenarios"], dtype=np.float32)
        precautions = np.asarray(state["precautions"], dtype=np.float32)
        head = LinearHead.from_bytes(state["head"].tobytes()) if "head" in state.files else None
    params = RoutingParams.from_dict(json.loads((directory / ROUTER_PARAMS).read_text()))
    # One text per call, as the int8 query engine: a list embedded in padded batches gave a
    # query another vector (in the last bits) than alone, so the routing API's batch form
    # scored it otherwise than its single form, and the cache kept whichever came first.
    engine = EmbeddingEngine(str(directory), batch_size=1)
    return LoadedTunedRouter(engine, scenarios, precautions, head, params)


# --- the manifest: what a client downloads and checks -----------------------------------------


def rows_digest(compendium: Compendium) -> str:
    """sha256 of the compendium's scenario and precaution rows in order (tool id and text): the
    saved vectors are row-aligned with exactly these rows, so a router may use them for another
    copy of the compendium only when this digest is the same."""
    digest = hashlib.sha256(b"synapse-router-rows-v1\0")
    for kind, rows in (("s", compendium.scenarios), ("p", compendium.precautions)):
        for row in rows:
            line = json.dumps([kind, row.tool_id, row.text], ensure_ascii=False)
            digest.update(line.encode("utf-8", "surrogatepass") + b"\n")
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: str | Path, compendium: Compendium, **fields) -> dict:
    """Write `ROUTER_MANIFEST` in `directory` (atomically) and return it: every other file's
    relative path, size and sha256, the rows digest of `compendium` (the one the vectors were
    computed for) and `fields` (e.g. round, global_sha256, epochs)."""
    directory = Path(directory)
    files = [
        {
            "path": path.relative_to(directory).as_posix(),
            "size": path.stat().st_size,
            "sha256": file_sha256(path),
        }
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != ROUTER_MANIFEST and not path.name.startswith(".")
        and path.relative_to(directory).parts[0] != DELTA_DIR
    ]
    try:
        bases = json.loads((directory / DELTA_DIR / DELTA_BASES).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        bases = {}
    for entry in files:
        delta = directory / DELTA_DIR / (entry["path"] + DELTA_SUFFIX)
        if isinstance(bases, dict) and _is_sha256(bases.get(entry["path"])) and delta.is_file():
            entry["delta"] = {
                "path": delta.relative_to(directory).as_posix(),
                "size": delta.stat().st_size,
                "sha256": file_sha256(delta),
                "base_sha256": bases[entry["path"]],
            }
    manifest = {
        "format": MANIFEST_FORMAT,
        **fields,
        "rows_sha256": rows_digest(compendium),
        "scenarios": len(compendium.scenarios),
        "precautions": len(compendium.precautions),
        "files": files,
        "total_bytes": sum(f["size"] for f in files),
    }
    data = json.dumps(manifest, indent=1, sort_keys=True).encode("utf-8")
    fd, tmp = tempfile.mkstemp(prefix=f".{ROUTER_MANIFEST}.", dir=directory)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, directory / ROUTER_MANIFEST)
    return manifest


def read_manifest(directory: str | Path) -> dict | None:
    """The folder's manifest, or None when it has none (a router tuned before manifests) or it
    cannot be read."""
    try:
        manifest = json.loads((Path(directory) / ROUTER_MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: nested past the parser
        return None
    return manifest if isinstance(manifest, dict) else None


def manifest_problem(manifest: object) -> str | None:
    """Why `manifest` is not one a client may download by (safe relative paths, sizes, sha256
    digests, the rows digest), or None."""
    if not isinstance(manifest, dict):
        return "not a JSON object"
    if manifest.get("format") != MANIFEST_FORMAT:
        return f"format {manifest.get('format')!r}, not {MANIFEST_FORMAT}"
    if not _is_sha256(manifest.get("rows_sha256")):
        return "no rows_sha256"
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        return "no files"
    seen = set()
    for entry in files:
        problem = _entry_problem(entry)
        if problem:
            return problem
        if entry["path"] in seen:
            return f"{entry['path']} is listed twice"
        seen.add(entry["path"])
        delta = entry.get("delta")
        if delta is not None:
            problem = _entry_problem(delta)
            if problem:
                return f"{entry['path']}: delta: {problem}"
            if not _is_sha256(delta.get("base_sha256")):
                return f"{entry['path']}: delta: bad base_sha256"
    for required in (ROUTER_STATE, ROUTER_PARAMS):
        if required not in seen:
            return f"no {required}"
    return None


def _entry_problem(entry: object) -> str | None:
    """Why a manifest entry ({path, size, sha256}) is unusable, or None."""
    if not isinstance(entry, dict):
        return "an entry is not an object"
    path, size = entry.get("path"), entry.get("size")
    if not isinstance(path, str) or not _safe_relative(path):
        return f"unsafe file path {path!r}"
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        return f"{path}: bad size {size!r}"
    if not _is_sha256(entry.get("sha256")):
        return f"{path}: bad sha256"
    return None


def _is_sha256(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def _safe_relative(path: str) -> bool:
    """A plain relative POSIX path inside the folder: no absolute path, drive, '..', '.', empty
    or hidden part, no backslash, only printable characters."""
    if not path or len(path) > 255 or "\\" in path or not path.isprintable():
        return False
    parts = path.split("/")
    return all(part and not part.startswith(".") and ":" not in part for part in parts)


DELTA_SUFFIX = ".xor.zst"


def write_weight_deltas(directory: str | Path, base_model: str | None = None) -> list[str]:
    """Beside each `*.safetensors` file of the tuned model in `directory`, under `DELTA_DIR`, a
    lossless delta against the same file of `base_model` (default: the bundled MiniLM) when it
    saves at least a tenth of the bytes, with the base file's sha256 in `DELTA_BASES`. Returns
    the paths given a delta (none when the base has no such files)."""
    from routing.embeddings import DEFAULT_MODEL, _resolve
    from routing.weights_delta import make_delta

    directory = Path(directory)
    base_dir = Path(_resolve(base_model or DEFAULT_MODEL))
    bases = {}
    for target in sorted(directory.glob("*.safetensors")):
        base = base_dir / target.name
        if not base.is_file():
            continue
        delta = make_delta(target, base)
        if len(delta) > 0.9 * target.stat().st_size:
            continue
        (directory / DELTA_DIR).mkdir(exist_ok=True)
        (directory / DELTA_DIR / (target.name + DELTA_SUFFIX)).write_bytes(delta)
        bases[target.name] = file_sha256(base)
    if bases:
        (directory / DELTA_DIR / DELTA_BASES).write_text(json.dumps(bases, indent=1))
    return sorted(bases)
