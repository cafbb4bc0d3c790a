"""Grade-school math from reasoning-gym's ``gsm_symbolic`` templates, bucketed by solution steps.

**These are NOT Apple's GSM-Symbolic P1/P2 splits.**  Apple's P1/P2 add one or two clauses to
each MAIN template; reasoning-gym ships only MAIN-style templates (85 usable ones) and its config
has no difficulty knob (``difficulty`` must be 1.0).  As an offline stand-in we bucket the
templates by the number of solution steps in their chain of thought (non-empty lines of
``answer_cot`` other than the final ``#### answer`` line), which is fixed per template:

===== ============ ================ =========================
level name         steps            templates (reasoning-gym 0.1.25)
===== ============ ================ =========================
0     MAIN-like    <= 2             26
1     P1-like      3                24
2     P2-like      >= 4             35
===== ============ ================ =========================

Rows: prompt = ``"<question>\\nAnswer:"``, answer = the template's final numeric answer as a
string.  ``score`` uses reasoning-gym's own ``GSMSymbolicDataset.score_answer`` (reward 1.0 means
correct), which extracts the *first* number in the prediction, so text around that number is
tolerated.
"""

from __future__ import annotations

import functools
import random

from data_prep.common import Task, level_rng

LEVEL_NAMES = {0: "MAIN-like", 1: "P1-like", 2: "P2-like"}


def _bucket(steps: int) -> int:
    if steps <= 2:
        return 0
    if steps == 3:
        return 1
    return 2


def count_steps(answer_cot: str) -> int:
    """Number of solution steps: non-empty CoT lines other than the final ``####`` line."""
    return sum(1 for line in answer_cot.splitlines() if line.strip() and not line.lstrip().startswith("####"))


@functools.cache
def _dataset():
    # Imported lazily: reasoning_gym takes ~1 s to import and most tasks do not need it.
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import GSMSymbolicDataset, GSMSymbolicDatasetConfig

    return GSMSymbolicDataset(GSMSymbolicDatasetConfig(seed=0, size=1))


@functools.cache
def template_levels() -> dict[int, int]:
    """Maps each usable reasoning-gym template id to its level (0/1/2)."""
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok

    gens = _dataset().generators
    # Step count is constant per template; one sample with a fixed seed is enough.
    return {t: _bucket(count_steps(gens[t](random.Random(0), 1.0)["metadata"]["answer_cot"])) for t in tasks_ok}


@functools.lru_cache(maxsize=64)
def _generate_cached(level: int, n: int, seed: int) -> tuple[tuple[tuple[str, object], ...], ...]:
    # Cached per (level, n, seed) because build_splits may ask for the same rows twice; rows
    # are stored as tuples so the cache cannot be mutated by a caller.
    templates = sorted(t for t, lv in template_levels().items() if lv == level)
    gens = _dataset().generators
    rng = level_rng("gsm", level, seed)
    rows = []
    for _ in range(n):
        t = rng.choice(templates)
        ex = gens[t](random.Random(rng.getrandbits(63)), 1.0)
        row = {
            "prompt": ex["question"].strip() + "\nAnswer:",
            "answer": str(ex["answer"]).strip(),
            "difficulty": level,
            "task": "gsm",
        }
        rows.append(tuple(row.items()))
    return tuple(rows)


def generate(level: int, n: int, seed: int) -> list[dict]:
    """Generates ``n`` rows from the templates of step bucket ``level`` (0, 1 or 2)."""
    return [dict(r) for r in _generate_cached(level, n, seed)]


def score(prediction: str, answer: str) -> bool:
    """reasoning-gym's scorer: the first number in ``prediction`` must equal ``answer``."""
    if not isinstance(prediction, str):
        return False
    return _dataset().score_answer(prediction, {"answer": answer}) == 1.0


TASK = Task(
    name="gsm",
    knob="steps",
    default_train_levels=[0, 1],
    interp_levels=[],
    extrap_levels=[2],
    generate_fn=generate,
    score_fn=score,
    min_level=0,
    max_level=2,
    level_names=dict(LEVEL_NAMES),
    description="reasoning-gym gsm_symbolic templates bucketed by solution steps (NOT Apple's P1/P2)",
)
