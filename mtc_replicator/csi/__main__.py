"""``python -m mtc_replicator.csi``: the same entry point as the ``mtc-csi`` console script."""

import sys

from mtc_replicator.csi.plugin import main

sys.exit(main())
