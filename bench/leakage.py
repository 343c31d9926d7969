"""The leakage guard's reworded-request rule: how well it tells a request reworded from a different one on the
hand-written pairs, before and after, and what it costs at the sizes the guard meets.

    .venv/bin/python bench/leakage.py [--sizes 100,1000,2000] [--freeze 300] [--threads 2]

1. Quality. Every pair of tests/platform/evals/data/leakage_pairs.jsonl (132 requests reworded by hand, 181
   different requests sharing most words or all literal values) goes through the guard, one request joining a
   side while the other is on the opposite side:
   - after: `leakage.conflicts_between`, the rules promotion, variants and freezing run. "Refused" is a
     conflict no person can wave through, "asked" an "unsure" one (promotion asks the reviewer for a reason);
   - before: the rule as it stood (the clustering's distilled static embedding, cosine >= 0.90, and its
     literal check), rebuilt here from its code, with the same normalised-request rule beside it.
   Figures per half (threshold chosen on "tune", "test" held out) and on all pairs, with Wilson 95% intervals;
   the refusals per kind of pair; and the sweep of the threshold on the tuning half that chose it.
   Goal: rewordings caught (refused, or asked) >= 90%, different requests refused <= 10%.
2. Cost, with `--threads` torch threads:
   - loading the sentence model in a fresh process (what the first check of a web or worker process pays;
     one load a process, after that nothing);
   - encoding requests with the whole model against the distilled one (texts a second, and the ratio);
   - one promotion's check (`conflicts_between`: 1 request against `--sizes` rows of the other side): with
     no vector stored (the side's rows run through the model: once ever, for rows that came in before the
     guard kept vectors), in a fresh process with the vectors stored (`RequestVector`), and warm;
   - freezing: `--freeze` rows against `--freeze` * 4, vectors stored, in a fresh process.
   A scratch SQLite database (a temporary folder) holds the stored vectors.
   Requests for the timing are made from templates (ids, names and amounts drawn), not the labeled pairs.

The last line is JSON: {"after": {"test": {...}, "all": {...}}, "before": {...}, "cost": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
PAIRS = ROOT / "tests" / "platform" / "evals" / "data" / "leakage_pairs.jsonl"
PY = sys.executable


def _setup_django(var_dir: str) -> None:
    """A scratch SQLite database in `var_dir`, migrated: the guard keeps request vectors there."""
    os.environ["DJANGO_SETTINGS_MODULE"] = "flywheel.settings"
    os.environ["FLYWHEEL_VAR_DIR"] = var_dir
    os.environ["DATABASE_URL"] = f"sqlite:///{var_dir}/bench.sqlite3"
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


# --- the rule before: the distilled embedding at 0.90 and its literal check, as it stood --------------------

_OLD_TOKEN = re.compile(r"[\w@.+:/#-]+")
_OLD_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_OLD_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_OLD_SENTENCE_START = re.compile(r"(?:^|[.!?:;]\s*)$")


def _old_canonical(token: str) -> str:
    token = token.lower()
    if _OLD_NUMBER.fullmatch(token):
        return token.rstrip("0").rstrip(".") if "." in token else token
    return token.replace("-", "").replace("_", "")


def _old_literals(text: str) -> tuple[set[str], set[str]]:
    text = _OLD_THOUSANDS.sub("", text)
    literals: set[str] = set()
    words: set[str] = set()
    for match in _OLD_TOKEN.finditer(text):
        token = match.group().strip(".:/#-+")
        if not token:
            continue
        words.add(_old_canonical(token))
        if (any(ch.isdigit() for ch in token) or "@" in token or "://" in token
                or (len(token) > 1 and token[0].isupper() and not _OLD_SENTENCE_START.search(text[:match.start()]))):
            literals.add(_old_canonical(token))
    return literals, words


def _old_refuses(a: str, b: str, cosine: float) -> bool:
    from flywheel.evals import rows as row_shape

    digest = row_shape.prompt_digest
    if digest([{"role": "user", "content": a}]) == digest([{"role": "user", "content": b}]):
        return True
    literals_a, words_a = _old_literals(a)
    literals_b, words_b = _old_literals(b)
    return cosine >= 0.90 and literals_a <= words_b and literals_b <= words_a


# --- quality ----------------------------------------------------------------------------------------------------


def _figures(rows: list[tuple[dict, str]]) -> dict[str, dict]:
    from flywheel.registry.sequential import wilson

    same = [o for p, o in rows if p["same"]]
    different = [o for p, o in rows if not p["same"]]
    counts = {"reworded_refused": (same.count("refused"), len(same)),
              "reworded_caught": (len(same) - same.count("passed"), len(same)),
              "different_refused": (different.count("refused"), len(different)),
              "different_asked": (different.count("asked"), len(different))}
    return {name: {"k": k, "n": n, "rate": round(k / n, 4), "ci95": [round(x, 4) for x in wilson(k, n)]}
            for name, (k, n) in counts.items()}


def quality() -> dict:
    from flywheel.evals import leakage, rewording
    from flywheel.evals import rows as row_shape
    from flywheel.failures.clustering.embedding import shared_embedder

    pairs = [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines() if line.strip()]
    texts = sorted({t for p in pairs for t in (p["a"], p["b"])})
    leakage._vectors(tuple(texts))  # one batch through the model; the guard keeps the vectors

    def candidate(label: str, text: str) -> leakage.Candidate:
        return leakage.Candidate(label, None, row_shape.prompt_digest([{"role": "user", "content": text}]), text)

    def after(a: str, b: str) -> str:
        conflicts = leakage.conflicts_between([candidate("a", a)], [candidate("b", b)])
        return "refused" if leakage.certain(conflicts) else "asked" if conflicts else "passed"

    static = dict(zip(texts, shared_embedder().encode(texts), strict=True))
    results = {"after": [(p, after(p["a"], p["b"])) for p in pairs],
               "before": [(p, "refused" if _old_refuses(p["a"], p["b"], float(static[p["a"]] @ static[p["b"]]))
                           else "passed") for p in pairs]}
    out: dict = {}
    for name, rows in results.items():
        out[name] = {half: _figures([r for r in rows if half == "all" or r[0]["split"] == half])
                     for half in ("test", "tune", "all")}
        kinds: dict[str, list[int]] = {}
        for p, o in rows:
            kinds.setdefault(p["kind"], [0, 0])[0] += o == "refused"
            kinds[p["kind"]][1] += 1
        out[name]["refused_by_kind"] = {k: f"{r}/{n}" for k, (r, n) in sorted(kinds.items())}
    # How the threshold was chosen: on the tuning half, the most rewordings refused with at most 5% of the
    # different requests refused (half the goal: room for a new sample).
    vectors = leakage._vectors(tuple(texts))
    cos = {t: v for t, v in zip(texts, vectors, strict=True)}
    tune = [p for p in pairs if p["split"] == "tune"]
    sweep = {}
    chosen = rewording.REWORDED_COSINE
    try:
        for step in range(55, 76):
            rewording.REWORDED_COSINE = step / 100
            verdicts = [(p, rewording.judge(rewording.facts(p["a"]), rewording.facts(p["b"]),
                                            float(cos[p["a"]] @ cos[p["b"]])).verdict) for p in tune]
            same = [v for p, v in verdicts if p["same"]]
            diff = [v for p, v in verdicts if not p["same"]]
            sweep[f"{step / 100:.2f}"] = (round(same.count("same") / len(same), 3), round(diff.count("same") / len(diff), 3))
    finally:
        rewording.REWORDED_COSINE = chosen
    out["tune_sweep"] = {"threshold": chosen, "refused_rewordings/refused_different": sweep}
    # How close the held-out figures sit to the threshold: a CPU's numerics move a cosine by ~1e-6.
    margins = [abs(float(cos[p["a"]] @ cos[p["b"]]) - t) for p in pairs
               for t in (rewording.REWORDED_COSINE, rewording.OBJECT_COSINE)]
    out["closest_to_a_threshold"] = round(min(margins), 5)
    return out


# --- cost -------------------------------------------------------------------------------------------------------

_NAMES = "Ana Bob Carla Dev Elena Farid Grace Hugo Ines Jon Kim Lena Marco Nora Omar Priya Sam Tom".split()
_TEMPLATES = [
    "Refund {amount} dollars on order {order}, the {item} arrived broken.",
    "Could you book a meeting with {name} on {day} at {hour}pm?",
    "What's the status of ticket T-{n}?",
    "Transfer ${amount} from checking to savings.",
    "Please reset the VPN password for user {lower}{n}.",
    "Add {name} to the {item} review on {day}.",
    "Where is my order {order}? It was due {day}.",
    "Cancel the {item} subscription on account C-{n}.",
]


def _requests(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    days = "Monday Tuesday Wednesday Thursday Friday".split()
    items = "mug lamp design budget hiring roadmap chair desk".split()
    return [rng.choice(_TEMPLATES).format(amount=rng.randint(5, 900), order=f"A-{rng.randint(1000, 99999)}",
                                          item=rng.choice(items), name=rng.choice(_NAMES), day=rng.choice(days),
                                          hour=rng.randint(1, 6), n=rng.randint(10, 99999),
                                          lower=rng.choice(_NAMES).lower()) + f" ({i})" for i in range(n)]


def _cold_load(threads: int) -> float:
    code = (f"import time, torch; torch.set_num_threads({threads}); t = time.perf_counter();"
            "from flywheel.failures.clustering.embedding import shared_model; shared_model();"
            "print(time.perf_counter() - t)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT)])}
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def cost(sizes: list[int], freeze: int, threads: int) -> dict:
    import torch

    from flywheel.evals import leakage
    from flywheel.evals import rows as row_shape
    from flywheel.evals.models import RequestVector
    from flywheel.failures.clustering.embedding import shared_embedder, shared_model

    torch.set_num_threads(threads)
    out: dict = {"threads": threads, "model_load_s": round(_cold_load(threads), 2)}
    model, static = shared_model(), shared_embedder()
    sample = _requests(1000, seed=1)
    static.encode(sample[:50])  # its tokens distilled: the distilled side measured warm, as clustering runs
    start = time.perf_counter()
    model.encode(sample)
    whole = len(sample) / (time.perf_counter() - start)
    start = time.perf_counter()
    static.encode(sample)
    distilled = len(sample) / (time.perf_counter() - start)
    out["encode_texts_per_s"] = {"whole_model": round(whole), "distilled": round(distilled),
                                 "ratio": round(distilled / whole, 1)}

    def candidates(texts: list[str], prefix: str) -> list[leakage.Candidate]:
        return [leakage.Candidate(f"{prefix}-{i}", None, row_shape.prompt_digest([{"role": "user", "content": t}]), t)
                for i, t in enumerate(texts)]

    def timed(mine: list[leakage.Candidate], others: list[leakage.Candidate]) -> float:
        start = time.perf_counter()
        leakage.conflicts_between(mine, others)
        return round(time.perf_counter() - start, 3)

    checks = {}
    for size in sizes:
        others = candidates(_requests(size, seed=size), "other")
        RequestVector.objects.all().delete()
        leakage._vector_cache.clear()
        # Nothing stored: the side's rows are run through the model (once, ever: rows that came in before
        # vectors were kept); then a fresh process, vectors stored; then a warm one.
        first = timed(candidates(_requests(1, seed=size + 1), "new"), others)
        leakage._vector_cache.clear()
        stored = timed(candidates(_requests(1, seed=size + 2), "new"), others)
        warm = timed(candidates(_requests(1, seed=size + 3), "new"), others)
        checks[str(size)] = {"nothing_stored_s": first, "fresh_process_s": stored, "warm_s": warm}
    out["one_promotion_check"] = checks
    rows, others = candidates(_requests(freeze, seed=7), "row"), candidates(_requests(freeze * 4, seed=8), "other")
    leakage._vectors(tuple(c.prompt_text for c in rows + others))  # stored when the rows came in
    leakage._vector_cache.clear()
    start = time.perf_counter()
    found = leakage.conflicts_between(rows, others)
    out["freeze"] = {"rows": freeze, "other_side": freeze * 4, "fresh_process_s": round(time.perf_counter() - start, 2),
                     "conflicts": len(found)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100,1000,2000")
    parser.add_argument("--freeze", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as var_dir:
        _setup_django(var_dir)
        run(args)


def run(args: argparse.Namespace) -> None:
    result = quality()
    for name in ("before", "after"):
        print(f"{name}:")
        for half in ("test", "tune", "all"):
            figures = result[name][half]
            print(f"  {half:5} " + "  ".join(f"{k} {v['k']}/{v['n']}={v['rate']:.3f} ({v['ci95'][0]:.3f}-{v['ci95'][1]:.3f})"
                                            for k, v in figures.items()))
        print(f"  refused by kind: {result[name]['refused_by_kind']}")
    print(f"threshold sweep on the tuning half (refused rewordings, refused different): {result['tune_sweep']}")
    result["cost"] = cost([int(s) for s in args.sizes.split(",")], args.freeze, args.threads)
    print(f"cost: {result['cost']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
