"""Stoker's data path: a read-only FUSE filesystem over an S3 bucket/prefix."""

__version__ = "0.1.0"
