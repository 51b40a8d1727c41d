"""`python -m fusecore serve-mount`: a mount's serving process, with the data path and nothing else
imported (`python -m stoker` would load the CSI, operator and bench front ends: grpc, the kubernetes
client, jsonschema, about 60 MiB a mount would carry for nothing)."""

import logging
import os
import sys

from .process.cli import serve_main
from .store.native_http import hold_thread_states

hold_thread_states()  # safe here: this process never finalizes (below)
code = serve_main(sys.argv[1:])
# Unmounted and closed: all the mount's state was in memory, so the process ends here rather than finalize
# its heap (a collection of every module's objects took 1.7 s after an unmount here, longer under load, and
# a pod's or node plugin's unmount waited for it). Logs and output are flushed first.
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
