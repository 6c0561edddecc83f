"""Entry point: `python -m dataprep ...` (see dataprep.cli)."""

import sys

from dataprep import process

process.own()  # before pyarrow is imported (dataprep.process)

from dataprep.cli import main  # noqa: E402

sys.exit(main())
