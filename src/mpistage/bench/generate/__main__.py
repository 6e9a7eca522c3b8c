"""``python -m mpistage.bench.generate DIR ...``: ``mpistage bench generate``."""

import sys

from mpistage.bench.generate.cli import cli_generate

sys.exit(cli_generate(sys.argv[1:]))
