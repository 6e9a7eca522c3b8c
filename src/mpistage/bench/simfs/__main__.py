"""``python -m mpistage.bench.simfs {serve,mount,unmount,stats} ...``."""

import sys

from mpistage.bench.simfs.cli import main

sys.exit(main())
