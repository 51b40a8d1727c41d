"""The committed stubs match csi.proto (regenerated with grpcio-tools and compared)."""

from __future__ import annotations

import ast
import os

from csi import codegen, csi_pb2


def _serialized_descriptor(path: str) -> bytes:
    """The file descriptor protoc embedded, read without importing (which would register it twice)."""
    source = open(path).read()
    start = source.index("AddSerializedFile(") + len("AddSerializedFile(")
    end = source.index(")\n", start)
    return ast.literal_eval(source[start:end])


def test_committed_stubs_match_the_proto(tmp_path):
    codegen.generate(str(tmp_path))
    fresh = _serialized_descriptor(str(tmp_path / "csi" / "csi_pb2.py"))
    assert fresh == csi_pb2.DESCRIPTOR.serialized_pb
    fresh_grpc = (tmp_path / "csi" / "csi_pb2_grpc.py").read_text()
    committed_grpc = open(os.path.join(codegen.PACKAGE_DIR, "csi_pb2_grpc.py")).read()
    assert [line for line in fresh_grpc.splitlines() if "VERSION" not in line] == \
        [line for line in committed_grpc.splitlines() if "VERSION" not in line]


def test_wire_names_follow_the_csi_spec():
    services = {s.full_name: [m.name for m in s.methods] for s in csi_pb2.DESCRIPTOR.services_by_name.values()}
    assert set(services) == {"csi.v1.Identity", "csi.v1.Controller", "csi.v1.Node"}
    fields = {f.name: f.number for f in csi_pb2.NodePublishVolumeRequest.DESCRIPTOR.fields}
    assert fields == {"volume_id": 1, "publish_context": 2, "staging_target_path": 3, "target_path": 4,
                      "volume_capability": 5, "readonly": 6, "secrets": 7, "volume_context": 8}
