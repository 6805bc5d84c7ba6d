"""`python -m neuralgrid.cli`."""

import sys

from neuralgrid.cli import app

sys.exit(app())
