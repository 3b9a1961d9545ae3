"""The profile store: one ConfigMap per namespace holding device profiles (pure builder).

Keys are :func:`hettrain.planning.calibration.store_key` (device, model shape, image,
precision); each value is a ``DeviceProfile`` YAML document (``planning/profiles.py``), written
by calibration (measured stage times) or by a profiling pod. Every job of the namespace with
the same key plans with it. The ConfigMap has no owner: it outlives the jobs that filled it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hettrain.api import constants as c
from hettrain.manifests.builders import MANAGED_BY

PROFILE_STORE = "hettrain-profiles"  # ConfigMap name, in each job's namespace
COMPONENT = "profile-store"


def build_profile_store(namespace: str, entries: Mapping[str, str]) -> dict[str, Any]:
    """The store ConfigMap with ``entries`` ({key: profile YAML})."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": PROFILE_STORE, "namespace": namespace,
                         "labels": {c.LABEL_APP_NAME: "hettrain",
                                    c.LABEL_APP_COMPONENT: COMPONENT,
                                    c.LABEL_APP_MANAGED_BY: MANAGED_BY}},
            "data": dict(entries)}
