"""``python -m data_prep`` is the same command as ``python -m data_prep.build``."""

import sys

from data_prep.build import main

sys.exit(main())
