"""Generate csi_pb2.py / csi_pb2_grpc.py from csi.proto with grpcio-tools (`python -m csi.codegen`).

The generated files are committed so that running the plugin needs only grpcio and protobuf;
tests/csi/test_codegen.py regenerates them and fails if they drifted from the .proto.
"""

from __future__ import annotations

import os
import sys

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
PROTO = "csi/csi.proto"


def generate(out_dir: str) -> None:
    """Write the two generated modules under out_dir/csi/."""
    import grpc_tools
    from grpc_tools import protoc

    root = os.path.dirname(PACKAGE_DIR)
    includes = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    os.makedirs(os.path.join(out_dir, "csi"), exist_ok=True)
    status = protoc.main(["grpc_tools.protoc", f"-I{root}", f"-I{includes}", f"--python_out={out_dir}",
                          f"--grpc_python_out={out_dir}", os.path.join(root, PROTO)])
    if status != 0:
        raise RuntimeError(f"protoc failed with status {status}")


if __name__ == "__main__":
    generate(os.path.dirname(PACKAGE_DIR))
    sys.exit(0)
