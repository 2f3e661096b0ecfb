"""Old home of the development broker, kept so that ``python -m kstore.devbroker`` and
``from kstore.devbroker import Cluster`` go on working: it lives in :mod:`kstore.dev.broker`.

Only re-exports. Nothing in kstore imports this module; a test that patches the broker's
internals patches :mod:`kstore.dev.broker`, where they are looked up.
"""

from __future__ import annotations

import sys

from kstore.dev.broker import (
    DEFAULT_VERSION,
    Broker,
    Cluster,
    ClusterState,
    DevBrokerError,
    SecuredBroker,
    SecuredEndpoints,
    cache_root,
    fetch_jars,
    main,
    run_tool,
)

__all__ = [
    "DEFAULT_VERSION", "Broker", "Cluster", "ClusterState", "DevBrokerError", "SecuredBroker", "SecuredEndpoints",
    "cache_root", "fetch_jars", "main", "run_tool",
]

if __name__ == "__main__":
    sys.exit(main())
