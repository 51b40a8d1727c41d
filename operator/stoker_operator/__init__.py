"""Stoker's DatasetCache operator (kopf) and the node-side warm agent.

Importable as `stoker_operator` (the folder `operator/` keeps no __init__.py, so that nothing
shadows Python's own `operator` module).
"""

GROUP = "stoker.dev"
VERSION = "v1alpha1"
PLURAL = "datasetcaches"
KIND = "DatasetCache"
GATE = "stoker.dev/dataset-warm"
CACHE_ANNOTATION = "stoker.dev/dataset-cache"
NODE_PLURAL = "datasetcachenodes"
NODE_KIND = "DatasetCacheNode"
