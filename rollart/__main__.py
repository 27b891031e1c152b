"""`python -m rollart ...` is the command line (`rollart.cli`)."""

import sys

from rollart.cli import main

sys.exit(main())
