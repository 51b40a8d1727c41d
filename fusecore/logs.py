"""One log format for every Stoker process (mount, CSI plugin, mounter, operator)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET = ("botocore", "boto3", "urllib3", "kubernetes")  # libraries that log every request at INFO/DEBUG


def configure(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=FORMAT)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
