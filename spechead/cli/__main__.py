"""``python -m spechead.cli``: the same as the ``spechead`` command."""

import sys

from spechead.cli import main

sys.exit(main())
