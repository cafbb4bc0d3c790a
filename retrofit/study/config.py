"""A study's YAML file, read into ``StudyConfig`` and checked before anything trains (docs/study.md).

::

    name: main                                  # the study's name (study.json, study.md)
    preset: ../configs/tah2_llama.yaml          # the recipe preset every arm starts from (relative to this file)
    set: {n_valid: 60}                          # recipe flags for every arm (the recipes' own flag names)
    budget: {max_steps: 240, per_device_train_batch_size: 8}   # the training budget: every arm, no override
    threads: 2                                  # torch threads per trial (in the trial key: it may change the numbers)
    keep_models: false                          # delete each trial's weights once its result JSON is written
    tuning: {seed: 0, learning_rates: [2.5e-4, 5.0e-4, 1.0e-3], eval: {...}}   # or seeds: [0, 6]: the mean
    testing: {seeds: [1, 2, 3], eval: {...}}
    arms:
      sft: {kind: sft}                          # the base as a plain causal LM (recipe.controls)
      fixed: {kind: fixed}                      # the looped model at max depth for every token
      tah2: {kind: looped}                      # the preset's own method
      anira_e: {kind: looped, preset: ../configs/anira_llama.yaml, enabled: false}
      tah2_two_stage: {like: tah2, set: {depth_warmup_steps: 80}}   # the tah2 arm with one more flag

A file may start from another with ``extends: main.yaml`` and say only what changes (``load_study``), and may
``reuse: [../../docs/studies/main]``: another study's folders whose finished trials count here when a trial has the
same key there (``runner.Study.result``; nothing is copied, ``--no-reuse`` runs them anew).
An arm may also carry ``set`` (its own recipe flags), ``learning_rates`` (its own grid, of the common size),
``description``, and ``like: OTHER``: start from that arm's kind, preset, flags and grid (``_like``). ``eval``
maps ``EvalOptions`` fields; the phases' defaults are ``TUNE_EVAL`` / ``TEST_EVAL``.
Errors name the key and what is allowed; fewer than 3 learning rates or test seeds only warn (``warnings``, shown
in study.md): a tiny study is a smoke test, not a result. ``trial.check_arms`` then parses every arm's flags with
the recipes' parser and checks the arms share the data and the budget (``SHARED``), before anything trains.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model.errors import RetrofitUserError
from ..recipe.yaml_file import read_yaml

#: what an arm trains (``retrofit.recipe``): the looped arm of its preset, or one of the control arms
ARM_KINDS = ("sft", "fixed", "looped")
#: recipe flags the study sets itself, per trial
RESERVED = ("learning_rate", "seed", "output_dir", "control", "report", "resume", "config", "calibrate_stop_share")
#: the settings every arm must share (the same data and budget: docs/study.md "Equal budget")
SHARED = (
    "task",
    "n_train",
    "n_eval",
    "n_valid",
    "task_seed",
    "train_levels",
    "extrap_levels",
    "interp_levels",
    "eval_n",
    "eval_levels",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "model",
)
#: the evaluation of a tuning trial (validation rows): exact match only, no frontier (what choosing needs)
TUNE_EVAL = dict(
    accuracy="teacher_forced_argmax",
    forced_depths=False,
    exit_policies=False,
    policy_generation=False,
    frontier=False,
    html_samples=0,
)
#: the evaluation of a test trial: the forced-depth curve and the frontier with random allocation and the oracle (the
#: main job's frontier, retrofit.recipe.main_job); depths at the producing positions ("predict": what decoding
#: computes), so a row's d̄ in the per-example Spearman is the d̄ of the steps that produce its answer tokens
TEST_EVAL = dict(
    accuracy="teacher_forced_argmax",
    alignment="predict",
    forced_depths=True,
    exit_policies=False,
    policy_generation=False,
    frontier=True,
    frontier_stop_shares=(0.1, 0.3, 0.5, 0.7, 0.9),
    frontier_random_draws=3,
    frontier_rows_per_level=25,
    html_samples=0,
)
MIN_LEARNING_RATES = 3
MIN_SEEDS = 3

_TOP = (
    "name",
    "description",
    "preset",
    "set",
    "budget",
    "threads",
    "keep_models",
    "tuning",
    "testing",
    "arms",
    "out",
    "extends",
    "reuse",
)
_ARM = ("kind", "preset", "set", "learning_rates", "enabled", "description", "like")
#: what ``like: ARM`` copies from the named arm (``enabled`` and ``description`` are each arm's own)
_INHERITED = ("kind", "preset", "set", "learning_rates")


@dataclass(frozen=True)
class Arm:
    """One arm of the study.

    Attributes:
        name: its key in ``arms``.
        kind: ``sft``, ``fixed`` or ``looped`` (``ARM_KINDS``).
        preset: the recipe preset it starts from (absolute).
        flags: recipe flags over the preset: the study's ``set``, the arm's ``set``, then ``budget``.
        learning_rates: its tuning grid.
        description: free text for study.md.
    """

    name: str
    kind: str
    preset: Path
    flags: tuple[tuple[str, Any], ...]
    learning_rates: tuple[float, ...]
    description: str = ""


@dataclass(frozen=True)
class StudyConfig:
    """A study file, resolved (module docstring)."""

    path: Path
    name: str
    arms: tuple[Arm, ...]
    tuning_seeds: tuple[int, ...]
    test_seeds: tuple[int, ...]
    tune_eval: dict = field(default_factory=dict)
    test_eval: dict = field(default_factory=dict)
    threads: int = 1
    keep_models: bool = False
    description: str = ""
    out: Path | None = None
    reuse: tuple[Path, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def tuning_seed(self) -> int:
        """The first tuning seed (the one, in a study tuned with one)."""
        return self.tuning_seeds[0]

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise RetrofitUserError(f"no arm {name!r} in {self.path}; arms: {', '.join(a.name for a in self.arms)}")


def _mapping(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RetrofitUserError(f"{where} must be a mapping, got {type(value).__name__}")
    return value


def _keys(d: dict, allowed: tuple[str, ...], where: str) -> None:
    bad = sorted(set(d) - set(allowed))
    if bad:
        raise RetrofitUserError(f"{where}: unknown key(s) {', '.join(map(str, bad))}; allowed: {', '.join(allowed)}")


def _flags(d: dict, where: str) -> dict:
    d = _mapping(d, where)
    bad = sorted(k for k in d if k in RESERVED)
    if bad:
        raise RetrofitUserError(f"{where}: {', '.join(bad)} is set by the study per trial; drop it from {where}")
    return d


def _lrs(value: Any, where: str) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise RetrofitUserError(f"{where} must be a non-empty list of learning rates, got {value!r}")
    try:
        lrs = tuple(float(x) for x in value)
    except (TypeError, ValueError):
        raise RetrofitUserError(f"{where} must hold numbers, got {value!r}") from None
    if any(not x > 0 for x in lrs) or len(set(lrs)) != len(lrs):
        raise RetrofitUserError(f"{where} must hold distinct positive learning rates, got {list(lrs)}")
    return tuple(sorted(lrs))


def _eval(value: Any, defaults: dict, where: str) -> dict:
    from ..evaluation.options import EvalOptions

    over = _mapping(value, where)
    names = {f.name for f in dataclasses.fields(EvalOptions)}
    bad = sorted(set(over) - names)
    if bad:
        raise RetrofitUserError(f"{where}: unknown EvalOptions field(s) {', '.join(bad)}; allowed: {sorted(names)}")
    merged = {**defaults, **{k: tuple(v) if isinstance(v, list) else v for k, v in over.items()}}
    if "progress" in merged:
        raise RetrofitUserError(f"{where}: progress is a flag of the command (--quiet), not of the study")
    try:
        EvalOptions(**merged)
    except ValueError as e:
        raise RetrofitUserError(f"{where}: {e}") from None
    return merged


def _tuning_seeds(tuning: dict) -> tuple[int, ...]:
    """``tuning.seed`` (one seed, default 0) or ``tuning.seeds`` (several: each rate's choice is the mean over them)."""
    if "seed" in tuning and "seeds" in tuning:
        raise RetrofitUserError("tuning: give seed (one tuning seed) or seeds (a list), not both")
    if "seeds" not in tuning:
        s = tuning.get("seed", 0)
        if isinstance(s, bool) or not isinstance(s, int):
            raise RetrofitUserError(f"tuning.seed must be an integer, got {s!r}")
        return (s,)
    s = tuning["seeds"]
    if not isinstance(s, (list, tuple)) or not s or not all(isinstance(x, int) and not isinstance(x, bool) for x in s):
        raise RetrofitUserError(f"tuning.seeds must be a non-empty list of integers, got {s!r}")
    if len(set(s)) != len(s):
        raise RetrofitUserError(f"tuning.seeds must be distinct, got {s}")
    return tuple(s)


def _few_seeds(n: int) -> str:
    return f"{n} test seed(s) (< {MIN_SEEDS}): the across-seed intervals are not a result"


def _merge(base: dict, over: dict) -> dict:
    """``over`` on ``base``: mappings merge key by key (recursively), anything else replaces, and a key set to null
    removes the base's (an arm, ``tuning.seed`` before ``tuning.seeds``) — except in a ``set``, where null is the
    flag's value (``decider_top_k: null``) and replaces the base's like any other value."""
    out = dict(base)
    for k, v in over.items():
        if k == "set" and isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        elif v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _like(arms: dict) -> dict:
    """The arms with each ``like: OTHER`` resolved: the other arm's ``kind``, ``preset``, ``set`` and
    ``learning_rates`` (``_INHERITED``) under the arm's own keys, its ``set`` merged flag by flag, so an arm that is
    "the tah2 arm with two flags changed" says only those two and follows the tah2 arm if that changes. The other arm
    may itself say ``like`` (resolved first) and may be disabled; ``enabled`` and ``description`` are not copied."""
    done: dict[str, dict] = {}

    def resolve(name: str, chain: tuple[str, ...]) -> dict:
        if name in done:
            return done[name]
        spec = _mapping(arms[name], f"arms.{name}")
        other = spec.get("like")
        if other is None:
            done[name] = spec
            return spec
        if not isinstance(other, str) or other not in arms:
            raise RetrofitUserError(
                f"arms.{name}.like must name another arm of the study ({', '.join(a for a in arms if a != name)}), "
                f"got {other!r}"
            )
        if other in (*chain, name):
            raise RetrofitUserError(f"arms.{(*chain, name)[0]}.like: {' -> '.join((*chain, name, other))} is a cycle")
        base = resolve(other, (*chain, name))
        out = {k: base[k] for k in _INHERITED if k in base}
        out["set"] = {**_mapping(base.get("set"), f"arms.{other}.set"), **_mapping(spec.get("set"), f"arms.{name}.set")}
        out.update({k: v for k, v in spec.items() if k not in ("like", "set")})
        done[name] = out
        return out

    return {name: resolve(name, ()) for name in arms}


def _absolute(raw: dict, here: Path) -> dict:
    """``raw`` with its file-relative paths (``preset``, each arm's ``preset``, ``out``, each ``reuse`` folder) made
    absolute, so that a file extending it from another folder reads them as their own file meant them."""
    raw = dict(raw)
    for k in ("preset", "out"):
        if isinstance(raw.get(k), str):
            raw[k] = str((here / raw[k]).resolve())
    if isinstance(raw.get("reuse"), list):
        raw["reuse"] = [str((here / p).resolve()) if isinstance(p, str) else p for p in raw["reuse"]]
    if isinstance(raw.get("arms"), dict):
        arms = {}
        for name, spec in raw["arms"].items():
            if isinstance(spec, dict) and isinstance(spec.get("preset"), str):
                spec = {**spec, "preset": str((here / spec["preset"]).resolve())}
            arms[name] = spec
        raw["arms"] = arms
    return raw


def _read(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """A study file as a mapping, its ``extends`` (another study file, relative to it) merged under it (``_merge``).
    What the base file says is checked as part of the result, so an extending file is checked whole."""
    if path in chain:
        raise RetrofitUserError(f"extends: {' -> '.join(p.name for p in (*chain, path))} is a cycle")
    if not path.is_file():
        where = f" (extends of {chain[-1]})" if chain else ""
        raise RetrofitUserError(f"study config {path} does not exist{where}")
    raw = _mapping(read_yaml(path, "study config"), str(path))
    _keys(raw, _TOP, str(path))
    raw = _absolute(raw, path.parent)
    base = raw.pop("extends", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise RetrofitUserError(f"{path}: extends must be the path of another study file, got {base!r}")
    inherited = _read((path.parent / base).resolve(), (*chain, path))
    inherited.pop("name", None)  # a study's name is its own: the file's stem unless it says one
    return _merge(inherited, raw)


def load_study(path: str | Path) -> StudyConfig:
    """Read and check a study file (module docstring); raises ``RetrofitUserError`` naming the first problem.

    ``extends: main.yaml`` starts from another study file (relative to this one) and changes it: mappings merge key
    by key (an arm named again merges into the base's arm), lists and values replace, and null removes the base's key
    (``ouro: null`` drops that arm; ``seed: null`` before ``seeds:``). Paths stay relative to the file that wrote
    them. The result is checked as one file; a trial's key depends only on what resolves, so a study written as an
    extension of another keeps the trials it had as a copy.
    """
    path = Path(path).resolve()
    raw = _read(path)
    here = path.parent
    warnings: list[str] = []

    def preset_of(value, where) -> Path:
        if not value:
            raise RetrofitUserError(
                f"{where}: a preset (a recipe YAML, e.g. recipes/configs/tah2_llama.yaml) is needed"
            )
        p = (here / value).resolve()
        if not p.is_file():
            raise RetrofitUserError(f"{where}: preset {p} does not exist")
        return p

    common = _flags(raw.get("set"), "set")
    budget = _flags(raw.get("budget"), "budget")
    tuning = _mapping(raw.get("tuning"), "tuning")
    _keys(tuning, ("seed", "seeds", "learning_rates", "eval"), "tuning")
    testing = _mapping(raw.get("testing"), "testing")
    _keys(testing, ("seeds", "eval"), "testing")
    grid = _lrs(tuning["learning_rates"], "tuning.learning_rates") if "learning_rates" in tuning else None
    arms_raw = _mapping(raw.get("arms"), "arms")
    for name, spec in arms_raw.items():
        _keys(_mapping(spec, f"arms.{name}"), _ARM, f"arms.{name}")
    arms = []
    for name, spec in _like(arms_raw).items():
        where = f"arms.{name}"
        if spec.get("kind") not in ARM_KINDS:
            raise RetrofitUserError(f"{where}.kind must be one of {', '.join(ARM_KINDS)}, got {spec.get('kind')!r}")
        if not spec.get("enabled", True):
            continue
        own = _flags(spec.get("set"), f"{where}.set")
        clash = sorted(set(own) & set(budget))
        if clash:
            raise RetrofitUserError(f"{where}.set overrides the budget ({', '.join(clash)}): every arm trains on it")
        lrs = _lrs(spec["learning_rates"], f"{where}.learning_rates") if "learning_rates" in spec else grid
        if lrs is None:
            raise RetrofitUserError(f"{where}: no learning-rate grid (tuning.learning_rates or {where}.learning_rates)")
        flags = {**common, **own, **budget}
        preset = preset_of(spec.get("preset") or raw.get("preset"), where)
        arms.append(Arm(name, spec["kind"], preset, tuple(flags.items()), lrs, str(spec.get("description", ""))))
    if not arms:
        raise RetrofitUserError(f"{path}: no enabled arm; arms need a kind ({', '.join(ARM_KINDS)})")
    sizes = {a.name: len(a.learning_rates) for a in arms}
    if len(set(sizes.values())) > 1:
        raise RetrofitUserError(
            "every arm gets the same number of tuning trials (equal tuning budget); grid sizes differ: "
            + ", ".join(f"{k} {v}" for k, v in sizes.items())
        )
    n_lr = next(iter(sizes.values()))
    if n_lr < MIN_LEARNING_RATES:
        warnings.append(f"{n_lr} learning rate(s) per arm (< {MIN_LEARNING_RATES}): a smoke test, not a tuned study")
    seeds = testing.get("seeds")
    if not isinstance(seeds, (list, tuple)) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise RetrofitUserError(f"testing.seeds must be a non-empty list of integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise RetrofitUserError(f"testing.seeds must be distinct, got {seeds}")
    if len(seeds) < MIN_SEEDS:
        warnings.append(_few_seeds(len(seeds)))
    tseeds = _tuning_seeds(tuning)
    both = sorted(set(tseeds) & set(seeds))
    if both:
        warnings.append(
            f"tuning seed {', '.join(map(str, both))} is also a test seed: that test run was part of the choice"
        )
    threads = raw.get("threads", 1)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise RetrofitUserError(f"threads must be a positive integer, got {threads!r}")
    if not isinstance(raw.get("name", path.stem), str):
        raise RetrofitUserError("name must be a string")
    reuse = raw.get("reuse") or []
    if not isinstance(reuse, list) or not all(isinstance(p, str) and p for p in reuse):
        raise RetrofitUserError(
            f"reuse must be a list of study folders (paths relative to the file, e.g. [../../docs/studies/main]), "
            f"got {raw.get('reuse')!r}"
        )
    return StudyConfig(
        path=path,
        name=raw.get("name", path.stem),
        arms=tuple(arms),
        tuning_seeds=tseeds,
        test_seeds=tuple(seeds),
        tune_eval=_eval(tuning.get("eval"), TUNE_EVAL, "tuning.eval"),
        test_eval=_eval(testing.get("eval"), TEST_EVAL, "testing.eval"),
        threads=threads,
        keep_models=bool(raw.get("keep_models", False)),
        description=str(raw.get("description", "")),
        out=(here / raw["out"]).resolve() if raw.get("out") else None,
        reuse=tuple(dict.fromkeys(Path(p) for p in reuse)),
        warnings=tuple(warnings),
    )


def select(cfg: StudyConfig, arms: list[str] | None = None, seeds: list[int] | None = None) -> StudyConfig:
    """A part of the study (``retrofit study --arms --seeds``): some of its enabled arms, some of its test seeds.

    The trials keep their keys (a trial's key does not depend on the other arms or seeds), so a part run into the
    study's folder is part of the whole: run the controls and the default arm on three seeds first, and the same
    command without ``--arms`` / ``--seeds`` later runs only what is missing. The part's study.json and study.md
    carry a warning naming what it leaves out.
    """
    if arms is None and seeds is None:
        return cfg
    names = [a.name for a in cfg.arms]
    keep_arms = names if arms is None else list(dict.fromkeys(arms))
    unknown = [a for a in keep_arms if a not in names]
    if unknown or not keep_arms:
        raise RetrofitUserError(
            f"--arms: {', '.join(unknown) or 'none given'} not among the enabled arms of {cfg.path.name} "
            f"({', '.join(names)}; an arm with enabled: false is turned on in the file)"
        )
    keep_seeds = list(cfg.test_seeds) if seeds is None else list(dict.fromkeys(seeds))
    extra = [s for s in keep_seeds if s not in cfg.test_seeds]
    if extra or not keep_seeds:
        raise RetrofitUserError(
            f"--seeds: {', '.join(map(str, extra)) or 'none given'} not among the test seeds of {cfg.path.name} "
            f"({', '.join(map(str, cfg.test_seeds))}); add a seed to testing.seeds in the file"
        )
    left = [n for n in names if n not in keep_arms]
    rest = [s for s in cfg.test_seeds if s not in keep_seeds]
    parts = ([f"arm(s) {', '.join(left)}"] if left else []) + (
        [f"test seed(s) {', '.join(map(str, rest))}"] if rest else []
    )
    warnings = list(cfg.warnings)
    if parts:
        warnings.append(f"a part of the study: it leaves out {' and '.join(parts)} (--arms / --seeds)")
    if len(keep_seeds) < MIN_SEEDS <= len(cfg.test_seeds):  # (a config with fewer already warns)
        warnings.append(_few_seeds(len(keep_seeds)))
    return dataclasses.replace(
        cfg,
        arms=tuple(a for a in cfg.arms if a.name in keep_arms),
        test_seeds=tuple(s for s in cfg.test_seeds if s in keep_seeds),
        warnings=tuple(warnings),
    )
