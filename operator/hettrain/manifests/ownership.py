"""Which HetTrainingJob owns an object: its controller ownerReference (kind, group, uid).

A label such as ``hettrain.dev/job`` can be put on anything by anyone; an ownerReference
with the uid of a live job cannot be forged into another tenant's namespace without write
access there. So the operator adopts, counts, merges into and deletes only objects whose
controller reference names the job by uid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hettrain.api import constants as c


def controller_job(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """(job name, job uid) of the object's controller ownerReference to a HetTrainingJob of
    our API group, or None."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if not ref.get("controller"):
            continue
        api = str(ref.get("apiVersion") or "")
        if ref.get("kind") == c.KIND and api.split("/")[0] == c.GROUP and ref.get("uid"):
            return str(ref.get("name") or ""), str(ref["uid"])
        return None  # one controller at most: someone else's
    return None


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether the object's controller is the HetTrainingJob with this uid (never for an
    empty uid)."""
    ref = controller_job(obj)
    return bool(uid) and ref is not None and ref[1] == uid
