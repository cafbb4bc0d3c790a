"""Files in and out: loading checkpoints (``loading``), Hub export (``export``, ``bundle``, ``model_card``) and
the rules for output folders (``output_paths``). Imports ``retrofit.model``; never ``training``, ``recipe``
or ``cli``.
"""
