"""Recipe orchestration: arguments (``args``), data (``data``), the train → save → controls → report block
(``run``), the control arms (``controls``) and the main-job report (``main_job``).

Imports ``retrofit.model``, ``retrofit.hub``, ``retrofit.training`` and ``retrofit.evaluation``; never
``cli``. ``recipes/*.py`` import from here (the names ``retrofit.recipe`` exported as one module).
"""

from __future__ import annotations

from ..model.lazy import lazy_exports

# name -> the module that defines it (imported on first use, so that importing one submodule stays light)
_EXPORTS = {
    "CONTROLS": ".args",
    "RecipeSpec": ".args",
    "ScriptArgs": ".args",
    "parse_levels": ".args",
    "parse_recipe_args": ".args",
    "load_data": ".data",
    "task_splits": ".data",
    "use_chat": ".data",
    "LoopArgs": "..training.model_setup",
    "freeze_prelude": "..training.model_setup",
    "identity_check": "..training.model_setup",
    "prepare_model": "..training.model_setup",
    "calibrate": ".run",
    "recipe_main": ".run",
    "run_recipe": ".run",
    "train_and_save": ".run",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
