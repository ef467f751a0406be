"""`python -m kvsieve.cli`: the command line, as the `kvsieve` script runs it."""

import sys

from kvsieve.cli import main

sys.exit(main())
