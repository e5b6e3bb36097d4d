"""``python -m replicafit.trainer`` is the ``replicafit`` command too (usually spelt ``python -m replicafit``)."""

import sys

from replicafit.cli import main

sys.exit(main())
