"""`python -m equilens.cli ...`: the `equilens` command."""

import sys

from ._main import main

sys.exit(main())
