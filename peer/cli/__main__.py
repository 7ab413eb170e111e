"""``python -m peer.cli``: the same entry point as the ``asyncmesh-peer`` console script."""

import sys

from peer.cli import main

sys.exit(main())
