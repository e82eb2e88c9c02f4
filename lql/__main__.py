"""``python -m lql`` is the ``lql`` command."""

import sys

from .cli import main

sys.exit(main())
