"""``python -m retrofit.lm_eval ARGS``: the same as ``retrofit lm-eval ARGS`` (:mod:`retrofit.lm_eval.cli`)."""

import sys

from retrofit.lm_eval.cli import main

if __name__ == "__main__":
    sys.exit(main())
