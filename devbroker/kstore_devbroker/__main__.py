"""``python -m kstore_devbroker fetch|start|stop|run``: the broker's command line
(:func:`kstore_devbroker.broker.main`)."""

import sys

from kstore_devbroker.broker import main

sys.exit(main())
