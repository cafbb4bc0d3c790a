"""``python -m retrofit.cli ...`` runs the ``retrofit`` command."""

import sys

from . import main

sys.exit(main())
