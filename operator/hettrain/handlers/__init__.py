"""kopf handlers: thin wrappers over :mod:`hettrain.reconcile`.

Run with ``kopf run -m hettrain.handlers --all-namespaces`` (HA: add ``--peering=hettrain
--priority=N`` after applying ``crds/kopf-peering.yaml``; single replica: ``--standalone``).
"""

from hettrain.handlers.job import *  # noqa: F403  (registers the handlers on import)
