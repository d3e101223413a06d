"""``python -m hybridstore`` runs the command line."""

import sys

from hybridstore.cli import main

sys.exit(main())
