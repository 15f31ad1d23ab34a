"""``python -m kvjax``: see ``kvjax.cli``."""

import sys

from kvjax.cli import main

sys.exit(main())
