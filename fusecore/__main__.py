"""`python -m fusecore serve-mount`: a mount's serving process, with the data path and nothing else
imported (`python -m stoker` would load the CSI, operator and bench front ends: grpc, the kubernetes
client, jsonschema, about 60 MiB a mount would carry for nothing)."""

import sys

from .cli import serve_main

sys.exit(serve_main(sys.argv[1:]))
