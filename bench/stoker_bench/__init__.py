"""Stoker's benchmark: an emulated cloud object store and side-by-side runs against the peers."""
