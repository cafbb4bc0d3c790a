"""``EvalOptions``: every setting of an evaluation run, with help and validation in one place.

``evaluate``, ``evaluate_task`` and ``retrofit eval`` all take these options; keyword arguments
of the same names override the fields of a given (or default) ``EvalOptions``, so the short
``evaluate(model, tok, "mano", batch_size=4)`` still works::

    from retrofit.evaluation import EvalOptions, evaluate
    opts = EvalOptions(accuracy="teacher_forced_argmax", exit_policies=False)
    evaluate(looped, tok, "mano", options=opts, compare=[("sft", sft, tok)])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from data_prep.common import ANSWER_SEP

from .analysis import ALIGNMENTS

__all__ = [
    "ACCURACY_MODES",
    "ALIGNMENTS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_N",
    "GENERATION_BACKENDS",
    "STRUCTURE_STRINGS",
    "EvalOptions",
    "resolve_options",
]

DEFAULT_N = 20
DEFAULT_BATCH_SIZE = 8
GENERATION_BACKENDS = ("auto", "generate", "loop")
STRUCTURE_STRINGS = ("generated", "gold")
ACCURACY_MODES = ("generate", "teacher_forced_argmax")
#: Old keyword names still accepted by ``evaluate`` / ``evaluate_task``.
LEGACY_NAMES = {"forced_generation": "forced_depths"}


def _help(text: str, default: Any = dataclasses.MISSING, **kw):
    return field(default=default, metadata={"help": text}, **kw)


@dataclass
class EvalOptions:
    """How an evaluation runs. Every field has a ``help`` entry in its metadata (``--help`` text)."""

    max_new_tokens: int | None = _help(
        "Generation budget per answer; None = the longest gold answer in tokens + 2 (room for the answer and "
        "its stop token).",
        None,
    )
    batch_size: int = _help("Sequences per forward; lower it if memory is short.", DEFAULT_BATCH_SIZE)
    chat: bool = _help("Wrap each prompt in the tokenizer's chat template (default: continue the raw prompt).", False)
    answer_sep: str = _help(
        "Text between a raw prompt and its answer (ignored with chat); the default is the one SFT formatting puts "
        "before a task row's answer (data_prep.common.ANSWER_SEP, a space), so a model is scored on the text it "
        "was trained on.",
        ANSWER_SEP,
    )
    accuracy: str = _help(
        "How accuracy (levels, forced depths, exit policies) is measured. 'generate': greedy generation scored "
        "by the task's scorer. 'teacher_forced_argmax': one teacher-forced forward per batch; a row is correct "
        "iff every gold answer token and then a stop token is the argmax given the gold prefix, which is exactly "
        "'greedy output == gold answer + stop' because every exit rule here is causal (a token's depth never "
        "depends on later tokens). It is a lower bound of 'generate' where the scorer accepts other strings "
        "(lano, brevo, whitespace variants), and does not stand for sampling.",
        "generate",
    )
    alignment: str = _help(
        "Whose depth an answer token gets in the teacher-forced depth statistics (d̄, E[d], LANO, BREVO): "
        "'input' = its own position's (ANIRA's convention, the compute spent reading it) or 'predict' = the "
        "position that produced it. Losses, token accuracies, exit policies, the per-token difficulty analysis "
        "and generation compute always use the producing position (what decoding computes).",
        "input",
    )
    structure_strings: str = _help(
        "Strings the LANO Spearman and BREVO regression are measured on: 'generated' (the model's own greedy "
        "answers, as ANIRA does) or 'gold' (the reference answers, teacher-forced).",
        "generated",
    )
    forced_depths: bool = _help(
        "Also measure accuracy with every token forced to each depth 1..D (the test-time scaling curve).",
        True,
    )
    exit_policies: bool = _help(
        "Run the depth-D forward with per-depth logits (looped models, D > 1) and report what it gives: the "
        "learned decider against the training-free exits (kl, state, confidence) at equal compute (plus one exact "
        "pass per engine policy), per-depth token accuracy and the first-vs-last depth loss change.",
        True,
    )
    policy_generation: bool = _help(
        "Also generate under each engine exit policy at its calibrated threshold (accuracy='generate' only).", True
    )
    frontier: bool = _help(
        "Measure the accuracy-compute frontier (docs/evaluation.md; needs accuracy='teacher_forced_argmax'): on "
        "the frontier rows, every model's (FLOPs per answer token, accuracy) — a looped model's decider at its "
        "own threshold and at each of frontier_thresholds, random allocation at each of those d̄ "
        "(frontier_random_draws seeded draws, paired test against the decider), every forced depth; a plain "
        "model's one point — plus the decider's realized gain per decile of its continue probability and the "
        "break-even d̄. Cost for a model with a decider and t distinct thresholds (its own included), in "
        "teacher-forced passes over the frontier rows: (t - 1) + t x draws + 1 (fewer where a threshold's "
        "answer steps all sit at depth 1 or D); other models add nothing.",
        False,
    )
    frontier_thresholds: tuple[float, ...] = _help(
        "Decider thresholds of the frontier sweep, each in [0, 1] (forward(decider_threshold=)): TaH2's τ_exit "
        "(higher: shallower), ANIRA-O's cumulative halting mass and ANIRA-E's allocation quantile (higher: "
        "deeper). The model's own threshold is always a point (the adaptive pass, not run again).",
        (0.1, 0.3, 0.5, 0.7, 0.9),
    )
    frontier_stop_shares: tuple[float, ...] | None = _help(
        "Place the frontier's sweep by compute instead (evaluation/calibrate.py): for each share s in [0, 1], the "
        "threshold at which a share s of the decider's first decisions at the frontier rows' answer steps stops "
        "after depth 1 (at M = 2, d̄ = 2 - s). Replaces frontier_thresholds; costs one more pass. None = use "
        "frontier_thresholds.",
        None,
    )
    frontier_random_draws: int = _help(
        "Seeded draws of random allocation at each threshold's d̄ (seeds 0..n-1; 0 = no random allocation).", 3
    )
    frontier_oracle: bool = _help(
        "With the frontier, a looped model with a decider also gets the oracle at equal compute at every decider "
        "point (the same number of continues spent on the answer steps whose next iteration lowers the gold "
        "token's loss most, from the forced-depth pass) and the accuracy ceiling (every answer step run to its "
        "first right depth), with decider vs oracle paired on the rows (retrofit/evaluation/oracle.py). Costs one "
        "pass per decider point plus one.",
        True,
    )
    share_first_depth: bool = _help(
        "A looped model's passes over the same batch share their first depth: the prelude, depth 1 of the core "
        "and depth 1's coda, which every exit policy computes alike before its first decision "
        "(retrofit.model.backends.share_first_depth). The results are bitwise those of separate forwards; the "
        "forced-depth pass and the frontier's passes after the first cost about a third as much. False: "
        "every pass computes everything (to check, or to save the memory it holds: at most 1 GiB).",
        True,
    )
    frontier_rows_per_level: int | None = _help(
        "Rows per level the frontier passes run on (the first ones of each level; None = every row). The "
        "frontier's passes dominate its cost: cap them here; the rest of the evaluation keeps every row.",
        None,
    )
    length_cutoffs: tuple[int, ...] | None = _help(
        "Output-length budgets in generated tokens, increasing (accuracy='generate' only): accuracy at each "
        "cutoff against decode FLOPs per row, and its slope per doubling of FLOPs (TaH2's measure for long "
        "answers), all from the one generation (greedy decoding is prefix-consistent; "
        "retrofit/evaluation/length_cutoffs.py). Each must be at most the generation budget (max_new_tokens). "
        "None = not measured.",
        None,
    )
    html_samples: int = _help("Generations per level shown in samples.html.", 2)
    progress: bool = _help("Show progress bars.", True)
    backend: str = _help(
        "Greedy decoding backend: 'generate' (the model's cached generate), 'loop' (reference: a full forward per "
        "step, no cache) or 'auto' (generate).",
        "auto",
    )

    difficulty_reference: str | None = _help(
        "Name of a compared model whose teacher-forced per-token loss measures each answer token's difficulty for "
        "the per-token depth analysis of every looped model; None = the first model of the run that is not looped.",
        None,
    )
    bootstrap_samples: int = _help("Resamples of the paired bootstrap of an accuracy difference.", 10_000)
    stats_seed: int = _help("Seed of the paired bootstrap.", 0)
    confidence: float = _help("Confidence level of the Wilson intervals and bootstrap intervals.", 0.95)

    def __post_init__(self):
        def positive_int(name: str, value: Any, allow_none: bool = False) -> None:
            if allow_none and value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                extra = "None (automatic) or " if allow_none else ""
                raise ValueError(f"{name} must be {extra}a positive int, got {value!r}")

        def choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")

        positive_int("batch_size", self.batch_size)
        positive_int("max_new_tokens", self.max_new_tokens, allow_none=True)
        choice("accuracy", self.accuracy, ACCURACY_MODES)
        choice("alignment", self.alignment, ALIGNMENTS)
        choice("backend", self.backend, GENERATION_BACKENDS)
        choice("structure_strings", self.structure_strings, STRUCTURE_STRINGS)
        positive_int("bootstrap_samples", self.bootstrap_samples)
        if isinstance(self.html_samples, bool) or not isinstance(self.html_samples, int) or self.html_samples < 0:
            raise ValueError(f"html_samples must be an int >= 0, got {self.html_samples!r}")
        if not isinstance(self.answer_sep, str):
            raise ValueError(f"answer_sep must be a string, got {type(self.answer_sep).__name__}")
        if not (isinstance(self.confidence, float) and 0.5 <= self.confidence < 1.0):
            raise ValueError(f"confidence must be a float in [0.5, 1), got {self.confidence!r}")
        if self.frontier and self.accuracy != "teacher_forced_argmax":
            raise ValueError(
                "frontier needs accuracy='teacher_forced_argmax' (random allocation of the answer steps is a "
                f"teacher-forced pass), got accuracy={self.accuracy!r}"
            )
        if not isinstance(self.frontier_thresholds, (list, tuple)) or not all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and 0.0 <= t <= 1.0
            for t in self.frontier_thresholds
        ):
            raise ValueError(f"frontier_thresholds must be numbers in [0, 1], got {self.frontier_thresholds!r}")
        self.frontier_thresholds = tuple(float(t) for t in self.frontier_thresholds)
        if self.frontier_stop_shares is not None:
            if not isinstance(self.frontier_stop_shares, (list, tuple)) or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and 0.0 <= t <= 1.0
                for t in self.frontier_stop_shares
            ):
                raise ValueError(f"frontier_stop_shares must be numbers in [0, 1], got {self.frontier_stop_shares!r}")
            self.frontier_stop_shares = tuple(float(t) for t in self.frontier_stop_shares)
        if (
            isinstance(self.frontier_random_draws, bool)
            or not isinstance(self.frontier_random_draws, int)
            or self.frontier_random_draws < 0
        ):
            raise ValueError(f"frontier_random_draws must be an int >= 0, got {self.frontier_random_draws!r}")
        positive_int("frontier_rows_per_level", self.frontier_rows_per_level, allow_none=True)
        if self.length_cutoffs is not None:
            cuts = self.length_cutoffs
            if (
                not isinstance(cuts, (list, tuple))
                or not cuts
                or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in cuts)
                or list(cuts) != sorted(set(cuts))
            ):
                raise ValueError(f"length_cutoffs must be increasing positive ints such as (16, 32, 64), got {cuts!r}")
            if self.accuracy != "generate":
                raise ValueError(
                    f"length_cutoffs scores generations: it needs accuracy='generate', got accuracy={self.accuracy!r}"
                )
            self.length_cutoffs = tuple(cuts)
        if self.difficulty_reference is not None and not isinstance(self.difficulty_reference, str):
            raise ValueError(f"difficulty_reference must be a model name or None, got {self.difficulty_reference!r}")


def resolve_options(options: EvalOptions | None, overrides: Mapping[str, Any]) -> EvalOptions:
    """``options`` (default ``EvalOptions()``) with keyword ``overrides`` applied (old names accepted).

    Raises:
        TypeError: an override that is not a field of ``EvalOptions``, naming the allowed ones.
    """
    if options is not None and not isinstance(options, EvalOptions):
        raise TypeError(f"options must be an EvalOptions, got {type(options).__name__}")
    names = {f.name for f in dataclasses.fields(EvalOptions)}
    changes = {}
    for key, value in overrides.items():
        key = LEGACY_NAMES.get(key, key)
        if key not in names:
            raise TypeError(f"unknown evaluation option {key!r}; allowed: {', '.join(sorted(names))}")
        changes[key] = value
    base = options if options is not None else EvalOptions()
    return dataclasses.replace(base, **changes) if changes else base
