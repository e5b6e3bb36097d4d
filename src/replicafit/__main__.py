"""``python -m replicafit`` is the ``replicafit`` command."""

import sys

from replicafit.trainer.cli import main

sys.exit(main())
