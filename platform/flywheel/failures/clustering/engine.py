"""The clustering engine: pure functions over plain data (messages, signals, vectors), no Django, so that the
job, the bench and the tests run the same code.

1. `signature(messages, signals)`: a failure's failing step in context (the user's request, the failing call
   or answer, the tool's result or error) and its structure (tool name, signal kinds, which checks failed,
   the failing call's argument names: on one tool, a call that sets a status and one that reassigns are
   different actions, and when no tool result follows the call, as in single-turn trajectories, nothing else
   tells them apart).
   The failing step is the message of the most telling signal that has a message index (STEP_PRIORITY),
   else the last assistant turn.
2. `features(signatures, embedder)`: the request and the failing step embedded apart (the step weighs more:
   it is the failure; the request is its context), and the structure as hashed one-hot features, weighted,
   concatenated, unit length. Hashing keeps the space the same from run to run, so stored centroids stay
   comparable.
3. `cluster(vectors)`: PCA to a dozen dimensions (16 for fewer than 1,000 failures), then scikit-learn's HDBSCAN on at most SAMPLE failures (the
   others join their nearest drawn failure's group); -1 is noise. Its min_cluster_size and min_samples follow
   the number of failures (`min_cluster_size_for`), so that 25 failures give groups as 10,000 do.
4. `describe(...)`: per cluster a label from class-based TF-IDF (its most distinctive terms) and its most
   distinctive signal, the members nearest its centre, its signal mix and its centroid.
5. `cluster_with_modes(...)` and `matches_dismissed(...)`: decisions that persist. Failures that cluster
   with an existing mode's members are suggested for that mode instead of forming a new group; a cluster that
   matches a dismissed group is not suggested again."""

from __future__ import annotations

import json
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# Which signal points at the failing step when several do: the one that explains the others (an unsafe or
# unparseable call explains the error after it; a tool error explains the missing answer).
STEP_PRIORITY = (
    "unsafe_action",
    "invalid_arguments",
    "undeclared_tool",
    "schema_violation",
    "loop",
    "tool_error",
    "human_intervention",
    "no_final_answer",
)
# The verifier check each signal kind reports as failed.
CHECK_OF_KIND = {
    "invalid_arguments": "json",
    "undeclared_tool": "declared",
    "schema_violation": "schema",
    "unsafe_action": "unsafe",
    "tool_error": "tool_result",
    "loop": "repeated_call",
    "no_final_answer": "final_answer",
    "negative_feedback": "feedback",
    "human_intervention": "intervention",
}
PIECE_CHARS = 600  # of each piece of a signature: the start says what it is
STRUCT_DIM = 64  # hashed structure features
W_REQUEST = 0.6  # weights of the parts of a failure's vector (each part unit length)
W_STEP = 1.0
# The structure weighs more than either text: on real failures (bench/clustering_api_fixture.py, 1,400-odd
# documented API operations) the cause does not follow the tool, and the requests' and calls' texts differ
# from one operation to the next far more than from one cause to the next. At 0.7, 1,500 such failures of five
# causes gave one group of 1,007 holding four of them (homogeneity 0.31); at 1.5 (with W_TOOL and W_ARGUMENTS
# below) 0.92. The project's own fixture holds (10,000 failures: see bench/clustering.py).
W_STRUCT = 1.5
# All of a call's argument names together, within the structure, where the tool weighs 1. Chosen on
# bench/clustering.py's fixtures (so their figures flatter it): from 0.75 to 0.85 both hold, the small sets'
# causes (two on one tool merge at 0.7) and the 10,000 failures' groups (two causes split at 0.9 and above).
W_ARGUMENTS = 0.5
# Dimensions kept by PCA before HDBSCAN, by the number of failures it sees (`pca_dims_for`). More keep more of
# the texts' variation, which on a large set of real failures is mostly the operation, not the cause: at 16, the
# real API failures (bench/clustering_api_fixture.py) at 5,000 and 30,000 failures and a 10,000 draw of 100,000
# each fell into one group holding four of the five causes (homogeneity 0.33; 14 failed too); at 12 every size
# from 1,500 to 100,000 held 0.89 to 0.93, and the project's own fixture 1.00 (bench/clustering.py). A few
# dozen failures are the other way round: at 12 (and 13, 14), 24 failures of two causes made three groups, one
# cause split by the names it hallucinated (forecast / get_forecast), while 16 keeps it whole; the small sets
# and the real API failures at 600 and 1,500 hold at 16 (0.88-0.98).
PCA_DIM_SMALL = 16
PCA_DIM = 12
PCA_SMALL_BELOW = 1000  # failures
# HDBSCAN runs on at most this many failures, drawn at random; each of the others joins the group of its
# nearest drawn failure when it lies within that failure's core distance (its density's reach), else it is
# noise. So a run's cost grows with the failures only through PCA and a nearest-neighbour query, and a cause
# large enough to be a group in a draw (min_cluster_size_for(SAMPLE) = 100 of 10,000: 1% of all failures) is
# found at any size. Measured on 100,000 failures: see bench/clustering.py.
SAMPLE = 10_000
# The tool's name, within the structure: less than a check, since a tool carries many causes (0.7; 1.0 with
# the structure at 1.5 gave 0.78 on the real API failures, 0.5 split the loop demo's groups across tools).
W_TOOL = 0.7
DISMISSED_THRESHOLD = 0.97  # cosine of a cluster's centroid to a dismissed group's to count as the same
DISMISSED_OVERLAP = 0.5  # or this share of its members were in the dismissed group
REPRESENTATIVES = 5

_NUMBER = re.compile(r"\d+(?:[.,:]\d+)*")
_ID = re.compile(r"\b[0-9a-f]{8,}\b|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b", re.I)
_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+\.[\w.]+\b")
_SPACE = re.compile(r"\s+")


class Embedder(Protocol):
    name: str
    dim: int

    def encode(self, texts: list[str]) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class Signature:
    """What a failure is, for clustering: the failing step in context, and its structure."""

    request: str  # the user's request before the failing step
    step: str  # the failing call (`name {arguments}`) or answer
    result: str  # the tool's result or error for that call; for an answer, the last tool result before it
    tool: str  # the failing call's tool, "" for an answer
    kinds: tuple[str, ...]  # signal kinds of the trajectory, sorted
    checks: tuple[str, ...]  # which checks failed, e.g. "schema", "schema:date", "unsafe"
    step_index: int | None = None
    arguments: tuple[str, ...] = ()  # the failing call's argument names, sorted

    @property
    def text(self) -> str:
        return "\n".join(p for p in (self.request, self.step, self.result) if p)

    @property
    def structure(self) -> list[str]:
        return (
            ([f"tool:{self.tool}"] if self.tool else ["tool:-"])
            + [f"kind:{k}" for k in self.kinds]
            + [f"check:{c}" for c in self.checks]
            + [f"arg:{a}" for a in self.arguments]
        )


def normalize(text: str) -> str:
    """Text as it is embedded and labelled: numbers, ids and addresses replaced, whitespace collapsed."""
    text = _EMAIL.sub(" email ", text)
    text = _ID.sub(" id ", text)
    text = _NUMBER.sub(" 0 ", text)
    return _SPACE.sub(" ", text).strip()


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else json.dumps(content, ensure_ascii=False, default=str)


def _cut(text: str) -> str:
    return text[:PIECE_CHARS]


def _argument_names(call: Any) -> tuple[str, ...]:
    """The names of a call's arguments, sorted; none when they do not parse as a JSON object."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return ()
    return tuple(sorted(str(k)[:40] for k in arguments)[:8]) if isinstance(arguments, dict) else ()


def _call_text(call: Any) -> tuple[str, str]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return "", ""
    name = str(function.get("name") or "")
    arguments = function.get("arguments")
    arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False, default=str)
    return name, f"{name} {arguments}"


def _tool_of(messages: Sequence[dict[str, Any]], index: int) -> str:
    """The tool whose result is message `index`."""
    call_id = messages[index].get("tool_call_id")
    for j in range(index - 1, -1, -1):
        for call in messages[j].get("tool_calls") or ():
            if isinstance(call, dict) and (call.get("id") == call_id or not call_id):
                return _call_text(call)[0]
    return str(messages[index].get("name") or "")


def _check_details(kind: str, detail: dict[str, Any]) -> list[str]:
    """Finer checks a signal's detail names: the argument a schema error is about, an unsafe rule."""
    out = []
    if kind == "schema_violation":
        for error in detail.get("errors", [])[:3]:
            at = re.search(r"\(at ([^)]+)\)", str(error))
            if at:
                out.append(f"schema:{at.group(1)}")
            elif "required property" in str(error):
                out.append("schema:required")
            elif "unexpected argument" in str(error):
                out.append("schema:unexpected")
    elif kind == "unsafe_action":
        for call in detail.get("calls", [])[:3]:
            if isinstance(call, dict):
                out.append(f"unsafe:{call.get('rule')}")
    return out


def signature(messages: Sequence[Any], signals: Iterable[dict[str, Any]]) -> Signature:
    """The signature of one failure. `signals` are triage signals as dicts: kind, message_index, detail."""
    messages = [m if isinstance(m, dict) else {} for m in (messages if isinstance(messages, list) else [])]
    signals = list(signals)
    kinds = tuple(sorted({str(s.get("kind")) for s in signals}))
    checks: set[str] = set()
    for s in signals:
        kind = str(s.get("kind"))
        if kind in CHECK_OF_KIND:
            checks.add(CHECK_OF_KIND[kind])
        detail = s.get("detail")
        checks.update(_check_details(kind, detail if isinstance(detail, dict) else {}))

    rank = {kind: i for i, kind in enumerate(STEP_PRIORITY)}
    located = [
        s for s in signals
        if s.get("kind") in rank and isinstance(s.get("message_index"), int) and 0 <= s["message_index"] < len(messages)
    ]  # fmt: skip
    index: int | None = None
    if located:
        best = min(located, key=lambda s: (rank[s["kind"]], s["message_index"]))
        index = best["message_index"]
    else:
        index = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"), None)

    tool = step = result = ""
    arguments: tuple[str, ...] = ()
    if index is not None:
        message = messages[index]
        role = message.get("role")
        if role == "tool":
            # A tool result: the failing step is the call it answers.
            call_id = message.get("tool_call_id")
            result = _text(message.get("content"))
            for j in range(index - 1, -1, -1):
                calls = messages[j].get("tool_calls") or []
                match = [c for c in calls if isinstance(c, dict) and c.get("id") == call_id] or (calls[:1] if not call_id else [])
                if match:
                    tool, step = _call_text(match[0])
                    arguments = _argument_names(match[0])
                    index = j
                    break
            else:
                tool = str(message.get("name") or "")
        elif role == "assistant" and message.get("tool_calls"):
            calls = [c for c in message["tool_calls"] if isinstance(c, dict)]
            texts = [_call_text(c) for c in calls]
            tool = texts[0][0] if texts else ""
            arguments = _argument_names(calls[0]) if calls else ()
            step = " ; ".join(t for _, t in texts)
            ids = {c.get("id") for c in calls}
            answers = [
                _text(m.get("content")) for m in messages[index + 1 : index + 1 + len(calls) * 2]
                if m.get("role") == "tool" and (m.get("tool_call_id") in ids or not m.get("tool_call_id"))
            ]  # fmt: skip
            result = " ; ".join(answers)
        else:
            step = _text(message.get("content"))
            # An answer: its context is the last tool result before it, and that tool is its structure.
            for j in range(index - 1, -1, -1):
                if messages[j].get("role") == "tool":
                    result = _text(messages[j].get("content"))
                    tool = _tool_of(messages, j)
                    break
    before = messages[: (index if index is not None else len(messages)) + 1]
    request = next((_text(m.get("content")) for m in reversed(before) if m.get("role") == "user"), "")
    return Signature(
        request=_cut(request),
        step=_cut(step),
        result=_cut(result),
        tool=tool[:80],
        kinds=kinds,
        checks=tuple(sorted(checks)),
        step_index=index,
        arguments=arguments,
    )


# --- vectors -----------------------------------------------------------------------------------------------


def _bucket(token: str) -> int:
    return zlib.crc32(token.encode("utf-8")) % STRUCT_DIM


def structure_vectors(signatures: Sequence[Signature]) -> np.ndarray:
    """Hashed one-hot of each signature's structure (tool, signal kinds, checks), unit length."""
    out = np.zeros((len(signatures), STRUCT_DIM), dtype=np.float32)
    for row, sig in enumerate(signatures):
        for token in sig.structure:
            # A check weighs as much as all the signal kinds together; the tool and the arguments less.
            if token.startswith("tool:"):
                weight = W_TOOL
            elif token.startswith("check:"):
                weight = 1.0
            elif token.startswith("arg:"):
                weight = W_ARGUMENTS / max(1, len(sig.arguments)) ** 0.5
            else:
                weight = 1.0 / max(1, len(sig.kinds)) ** 0.5
            out[row, _bucket(token)] += weight
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.where(norms > 0, norms, 1.0)


def features(signatures: Sequence[Signature], embedder: Embedder) -> np.ndarray:
    """One unit-length row per failure: its request, its failing step and its structure, weighted."""
    requests = [normalize(s.request) for s in signatures]
    steps = [normalize(f"{s.step}\n{s.result}") for s in signatures]
    text = embedder.encode(requests + steps)
    n = len(signatures)
    parts = [W_REQUEST * text[:n], W_STEP * text[n:], W_STRUCT * structure_vectors(signatures)]
    vectors = np.hstack(parts).astype(np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


def unit(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


def centroid(vectors: np.ndarray) -> np.ndarray:
    return unit(vectors.mean(axis=0)).astype(np.float32)


# --- clustering --------------------------------------------------------------------------------------------


def min_cluster_size_for(n: int) -> int:
    """The fewest failures HDBSCAN may call a group, among `n`: 1% of them on a large set (at most 100), an
    eighth of them on a small one (3 to 5; 2 below 12 failures).

    - Large sets (500 failures and more): 1%, so that a group is worth a reviewer's look and a big project's
      thousands of failures do not shatter into near-duplicates. HDBSCAN sees at most SAMPLE (10,000)
      failures, so this is at most 100 there: a cause of 1% of the failures is found at any size.
    - Small sets: an eighth, so that a cause that holds an eighth of the failures (any of up to eight even
      causes) can form a group. HDBSCAN never picks the root of its tree: it finds groups only where the set
      splits into parts of at least this size. With the old floor of 5, the loop demo's 25 failures (causes of
      3 to 12) never split into two fives and all 25 were noise: a new project saw no suggestion.
    - At least 3, where twelve failures or more leave room for four groups of 3: a pair is too often two
      variants of one cause split apart (measured: 2 split 20 failures of two causes into four groups, and
      the demo's 25 into eight). Below 12 failures, 2: a pair is the only group there is room for.
    - At most 5: the rule is the old one from 40 failures up (5, then 1% from 500), so the quality on large
      sets (bench/clustering.py) is unchanged."""
    floor = 3 if n >= 12 else 2
    return int(min(100, max(n // 100, min(5, max(floor, n // 8)))))


def pca_dims_for(n: int) -> int:
    """The dimensions PCA keeps for `n` failures: PCA_DIM_SMALL below PCA_SMALL_BELOW, else PCA_DIM."""
    return PCA_DIM_SMALL if n < PCA_SMALL_BELOW else PCA_DIM


def min_samples_for(min_cluster_size: int) -> int:
    """HDBSCAN's min_samples for groups of `min_cluster_size`: half of it, at least 2.

    min_samples is the neighbour count behind each failure's density (its core distance; scikit-learn counts
    the failure itself). Half the group size smooths a large set's density over tens of neighbours, so a
    cause of hundreds does not split on chance gaps; it is at most the group size, so a group of exactly
    that size can still be dense; and at least 2, so that a failure's density comes from its nearest other
    failure (with 1 it is its own, zero, and HDBSCAN falls back to single linkage, which chains unrelated
    failures together through the ones between them)."""
    return max(2, min_cluster_size // 2)


def cluster(vectors: np.ndarray, *, min_cluster_size: int | None = None, seed: int = 0) -> np.ndarray:
    """HDBSCAN labels (-1: noise) of unit-length rows, with min_cluster_size_for and min_samples_for the
    number of rows HDBSCAN sees (all of them, or SAMPLE drawn) unless `min_cluster_size` is given."""
    from sklearn.cluster import HDBSCAN
    from sklearn.decomposition import PCA
    from sklearn.neighbors import NearestNeighbors

    n = len(vectors)
    drawn = np.arange(n) if n <= SAMPLE else np.sort(np.random.default_rng(seed).choice(n, SAMPLE, replace=False))
    size = min_cluster_size or min_cluster_size_for(len(drawn))
    # Too few rows to split into a group and anything else: HDBSCAN would call them all noise anyway.
    if n < max(size + 1, 4):
        return np.full(n, -1, dtype=np.int64)
    dims = min(pca_dims_for(len(drawn)), vectors.shape[1], len(drawn) - 1)
    pca = PCA(n_components=dims, svd_solver="randomized", random_state=seed).fit(vectors[drawn])
    reduced = pca.transform(vectors).astype(np.float64)
    samples = min_samples_for(size)
    model = HDBSCAN(min_cluster_size=size, min_samples=samples, copy=True)
    found = model.fit_predict(reduced[drawn]).astype(np.int64)
    if len(drawn) == n:
        return found
    # The others: their nearest drawn failure's group, within its core distance (HDBSCAN's own: the distance
    # to its min_samples-th neighbour, itself counted).
    index = NearestNeighbors(n_neighbors=samples).fit(reduced[drawn])
    core = index.kneighbors(reduced[drawn])[0][:, -1]
    distance, nearest = (a[:, 0] for a in index.kneighbors(reduced, n_neighbors=1))
    labels = np.where(distance <= core[nearest], found[nearest], -1).astype(np.int64)
    labels[drawn] = found
    return labels


# --- description -------------------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z][a-z_]{2,}")
_LABEL_STOP = frozenset(
    "the and for you your with that this from are was were have has had not can could would will please "
    "what which when where how about into just some any all our out its it's get got let know need want "
    "sorry apologies went wrong side something unfortunately did does don't there here them they then than "
    "hi hello hey okay yes right now also like".split()
)


def _words(text: str) -> list[str]:
    return [w for w in _WORD.findall(normalize(text).lower()) if w not in _LABEL_STOP]


def ctfidf_terms(documents: Sequence[Sequence[str]], top: int = 4) -> list[list[str]]:
    """Class-based TF-IDF (BERTopic's c-TF-IDF): per class (a list of texts), its most distinctive words.

    tf is a word's share of the class's words; idf = log(1 + mean words per class / the word's count over all
    classes). A word common to every class scores low however frequent it is."""
    counts = [Counter(w for text in texts for w in _words(text)) for texts in documents]
    totals = Counter()
    for c in counts:
        totals.update(c)
    mean_words = sum(sum(c.values()) for c in counts) / max(1, len(counts))
    out = []
    for c in counts:
        size = sum(c.values()) or 1
        scored = sorted(
            ((count / size) * np.log(1 + mean_words / totals[w]), w) for w, count in c.items()
        )  # fmt: skip
        out.append([w for _, w in reversed(scored[-top:])])
    return out


@dataclass
class Cluster:
    """One suggestion, ready to be saved."""

    members: list[int]  # indexes into the failures
    label: str
    terms: list[str]
    signal: str  # its most distinctive signal kind
    tool: str
    representatives: list[int]  # indexes, nearest the centre first
    signals: dict[str, int]  # kind -> members carrying it
    centroid: np.ndarray = field(repr=False)


def _signal_mix(signatures: Sequence[Signature], members: Sequence[int]) -> dict[str, int]:
    mix = Counter(k for i in members for k in signatures[i].kinds)
    return dict(mix.most_common())


def describe(
    signatures: Sequence[Signature], vectors: np.ndarray, labels: np.ndarray, *, representatives: int = REPRESENTATIVES
) -> list[Cluster]:
    """Each cluster (not noise) with its label, representatives, signal mix and centroid; biggest first."""
    groups = [np.flatnonzero(labels == label) for label in sorted(set(labels.tolist()) - {-1})]
    if not groups:
        return []
    docs = [[f"{signatures[i].step} {signatures[i].result} {signatures[i].request}" for i in g] for g in groups]
    terms = ctfidf_terms(docs)
    overall = Counter(k for s in signatures for k in s.kinds)
    clusters = []
    for members, words in zip(groups, terms, strict=True):
        mix = _signal_mix(signatures, members)
        # The most distinctive signal: the one most over-represented here compared with all failures.
        signal = max(mix, key=lambda k: (mix[k] / len(members)) * np.log(1 + len(signatures) / overall[k]), default="")
        tool = Counter(signatures[i].tool for i in members).most_common(1)[0][0]
        centre = centroid(vectors[members])
        nearest = members[np.argsort(-(vectors[members] @ centre), kind="stable")[:representatives]]
        # The failing call's text holds the tool's name, so its words would name the tool a second time.
        named = {tool.lower(), *tool.lower().replace("-", "_").split("_")} | set(signal.lower().split("_"))
        own = [w for w in words if w.lower() not in named]
        label = " · ".join(p for p in (tool, signal.replace("_", " "), ", ".join(own[:3])) if p)
        clusters.append(
            Cluster(
                members=members.tolist(),
                label=label[:200],
                terms=words,
                signal=signal,
                tool=tool,
                representatives=nearest.tolist(),
                signals=mix,
                centroid=centre,
            )
        )
    clusters.sort(key=lambda c: -len(c.members))
    return clusters


# --- decisions that persist --------------------------------------------------------------------------------


def cluster_with_modes(
    vectors: np.ndarray, modes: dict[int, np.ndarray], *, min_cluster_size: int | None = None, seed: int = 0
) -> tuple[np.ndarray, dict[int, list[int]]]:
    """Cluster failures together with existing modes' members (`modes`: mode id -> its members' vectors,
    computed in this run). A cluster that holds members of a mode is that mode coming back: its failures are
    suggested for the mode (the mode with most members there) instead of forming a new group. So "close to a
    mode's members" means what it means for clustering, density, with no threshold of its own; and a few new
    failures of a known mode attach although they are too few to make a cluster alone.

    Returns (labels of the failures: -1 noise, -2 attached, else a new group; {mode id: [failure indexes]})."""
    modes = {m: v for m, v in modes.items() if len(v)}
    n = len(vectors)
    size = min_cluster_size or min_cluster_size_for(n)
    if not modes:
        return cluster(vectors, min_cluster_size=size, seed=seed), {}
    owners = np.concatenate([np.full(len(v), m, dtype=np.int64) for m, v in modes.items()])
    labels = cluster(np.vstack([vectors, *modes.values()]), min_cluster_size=size, seed=seed)
    mine, known = labels[:n].copy(), labels[n:]
    attached: dict[int, list[int]] = {}
    for label in set(known.tolist()) - {-1}:
        mode = Counter(owners[known == label].tolist()).most_common(1)[0][0]
        rows = np.flatnonzero(mine == label)
        if len(rows):
            attached.setdefault(int(mode), []).extend(int(r) for r in rows)
        mine[rows] = -2
    return mine, attached


@dataclass(frozen=True)
class DismissedGroup:
    centroid: np.ndarray | None
    members: frozenset[int]


def matches_dismissed(
    centre: np.ndarray,
    member_ids: Iterable[int],
    dismissed: Iterable[DismissedGroup],
    *,
    threshold: float = DISMISSED_THRESHOLD,
    overlap: float = DISMISSED_OVERLAP,
) -> bool:
    """Whether a cluster is one a reviewer dismissed: its centroid that close, or that share of its members."""
    members = set(member_ids)
    for group in dismissed:
        if group.centroid is not None and group.centroid.shape == centre.shape and float(centre @ group.centroid) >= threshold:
            return True
        if members and len(members & group.members) >= overlap * len(members):
            return True
    return False
