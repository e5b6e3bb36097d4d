"""``python -m replicafit.cli`` is the ``replicafit`` command too (usually spelt ``python -m replicafit``)."""

import sys

from . import main

sys.exit(main())
