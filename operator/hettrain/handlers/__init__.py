"""kopf handlers: thin wrappers over :mod:`hettrain.reconcile`."""
