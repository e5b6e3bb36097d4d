"""``python -m replicafit`` is the ``replicafit`` command."""

import sys

from replicafit.cli import main

sys.exit(main())
