"""`python -m ggufpy`: the same command line as the `ggufpy` console script."""

import sys

from .cli import main

sys.exit(main())
