"""hettrain: train one LLM across heterogeneous, multi-vendor, multi-datacenter GPU pools.

Data flows one way: ``CR spec -> inventory -> plan -> manifests -> API``. The packages
:mod:`hettrain.api`, :mod:`hettrain.planning`, :mod:`hettrain.manifests` and :mod:`hettrain.sim`
are pure (stdlib + pyyaml); import-linter contracts in ``.importlinter`` keep them so.
"""

__version__ = "0.1.0"
