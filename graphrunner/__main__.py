"""`python -m graphrunner`: the `graphrunner` console script."""

import sys

from graphrunner.cli import main

sys.exit(main())
