"""Entry point: `python -m dataprep ...` (see dataprep.cli)."""

import sys

from dataprep.cli import main

sys.exit(main())
