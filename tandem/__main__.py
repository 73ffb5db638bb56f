"""`python -m tandem`: the `tandem` command line."""

import sys

from tandem.entrypoints.cli import main

sys.exit(main())
