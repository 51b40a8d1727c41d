"""One log format for every Stoker process (mount, CSI plugin, mounter, operator)."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET = ("botocore", "boto3", "urllib3", "kubernetes")  # libraries that log every request at INFO/DEBUG


def configure(level: str, who: str = "", again: bool = False) -> None:
    """`who`: a name put before each line (a mount's worker process: "worker 2"); `again`: in a process forked from
    one that configured its own (a worker forked from its hub's template)."""
    logging.basicConfig(level=level.upper(), format=FORMAT.replace("%(name)s", f"[{who}] %(name)s") if who else FORMAT,
                        force=again)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
