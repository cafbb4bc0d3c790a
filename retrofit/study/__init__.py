"""``retrofit study CONFIG``: tuned, equal-budget, multi-seed comparisons of looped arms and their controls
(docs/study.md).

A study file names a base preset, its arms (the SFT control, the fixed-depth control, each adaptive method) and a
learning-rate grid; every arm is tuned on the validation rows with one seed (the same number of trials per arm),
then run at its chosen rate with several seeds on the test rows, and the effects are reported per seed and across
seeds. Modules: ``config`` (the YAML file, checked), ``trial`` (one training run through ``retrofit.recipe`` and one
evaluation through ``retrofit.evaluation``, one result JSON), ``runner`` (plan, resume, run, write), ``analysis``
(the statistics from the result JSONs alone), ``report`` (study.md, study.png), ``env`` (what the numbers depend on).

Imports ``retrofit.model``, ``retrofit.hub``, ``retrofit.training``, ``retrofit.recipe`` and ``retrofit.evaluation``;
never ``cli``. It is a package of its own because it sits above both ``recipe`` (training) and ``evaluation``, which
may not import each other's upper layer.
"""

from __future__ import annotations

from ..model.lazy import lazy_exports

_EXPORTS = {
    "StudyConfig": ".config",
    "load_study": ".config",
    "select": ".config",
    "Trial": ".trial",
    "run_trial": ".trial",
    "plan": ".runner",
    "run_study": ".runner",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
