"""``python -m commpress`` runs the command line."""

import sys

from commpress.cli import main

sys.exit(main())
