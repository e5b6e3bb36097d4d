"""``python -m trainer`` is the ``replicafit`` command."""

import sys

from .cli import main

sys.exit(main())
