"""Stoker CSI plugin: Identity, Node and Controller services over fusecore mounts."""
