"""``python -m csi``: the same entry point as the ``mtc-csi`` console script."""

import sys

from csi.plugin import main

sys.exit(main())
