"""`python -m fx_fusion ...`: the fx-fusion command line (see fx_fusion/cli.py)."""

import sys

from .cli import main

sys.exit(main())
