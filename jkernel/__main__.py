"""``python -m jkernel`` runs the command line (see :mod:`jkernel.cli`)."""

import sys

from .cli import main

sys.exit(main())
