"""Dynamic provisioning through a real gRPC client against a `stoker csi --mode controller`, on moto."""

from __future__ import annotations

import json

import grpc
import pytest

from csi import csi_pb2 as pb

from .conftest import READ_ONLY_MANY, SECRETS

pytestmark = pytest.mark.integration


def provisioner_secret(endpoint: str) -> dict[str, str]:
    """The older arrangement: the store location in the provisioner secret (still honoured on delete)."""
    return dict(SECRETS, endpointUrl=endpoint, region="us-east-1")


def store(endpoint: str) -> dict[str, str]:
    return {"endpointUrl": endpoint, "region": "us-east-1"}


def create(plugin, name, params, secrets, capacity=10 * 1024**3):
    return plugin.controller.CreateVolume(pb.CreateVolumeRequest(
        name=name, capacity_range=pb.CapacityRange(required_bytes=capacity), volume_capabilities=[READ_ONLY_MANY],
        parameters=params, secrets=secrets), timeout=60)


def keys(s3, bucket: str) -> set[str]:
    return {o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])}


def test_controller_mode_says_its_mode_not_an_empty_node_id(controller_plugin):
    line = next(l for l in controller_plugin.log().splitlines() if "serving CSI" in l)
    assert "controller mode" in line and "(node id" not in line, line  # it logged "(node id )"


def test_controller_capabilities(controller_plugin):
    caps = controller_plugin.identity.GetPluginCapabilities(pb.GetPluginCapabilitiesRequest())
    assert [c.service.type for c in caps.capabilities] == [pb.PluginCapability.Service.CONTROLLER_SERVICE]
    got = controller_plugin.controller.ControllerGetCapabilities(pb.ControllerGetCapabilitiesRequest())
    assert [c.rpc.type for c in got.capabilities] == [pb.ControllerServiceCapability.RPC.CREATE_DELETE_VOLUME]


def test_create_is_idempotent_and_delete_retains_data_by_default(controller_plugin, moto_server, s3, bucket):
    from csi.provision import Location, split_volume_id

    secret = dict(SECRETS)  # credentials only: the StorageClass says where the store is
    params = {"bucket": bucket, "prefix": "volumes", "cacheSize": "1GiB", **store(moto_server.endpoint),
              "csi.storage.k8s.io/pvc/name": "data"}
    first = create(controller_plugin, "pvc-123", params, secret).volume
    again = create(controller_plugin, "pvc-123", params, secret).volume
    assert first == again
    assert split_volume_id(first.volume_id) == Location(bucket, "volumes/pvc-123/", moto_server.endpoint, "us-east-1")
    assert first.capacity_bytes == 10 * 1024**3
    assert dict(first.volume_context) == {"bucket": bucket, "prefix": "volumes/pvc-123/", "cacheSize": "1GiB",
                                          **store(moto_server.endpoint)}
    marker = json.loads(s3.get_object(Bucket=bucket, Key="volumes/pvc-123/.stoker-volume.json")["Body"].read())
    assert marker["name"] == "pvc-123" and marker["on_delete"] == "Retain"
    code = pytest.raises(grpc.RpcError, create, controller_plugin, "pvc-123", params, secret, capacity=1).value.code()
    assert code == grpc.StatusCode.ALREADY_EXISTS
    s3.put_object(Bucket=bucket, Key="volumes/pvc-123/data.bin", Body=b"keep me")
    for _ in range(2):
        controller_plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=first.volume_id, secrets=secret))
    assert keys(s3, bucket) == {"volumes/pvc-123/data.bin"}


def test_delete_policy_removes_only_the_volume_prefix(controller_plugin, moto_server, s3, bucket):
    secret = provisioner_secret(moto_server.endpoint)  # the older arrangement still works
    volume = create(controller_plugin, "pvc-9", {"bucket": bucket, "onDelete": "Delete"}, secret).volume
    inside = [f"pvc-9/shard-{i}" for i in range(3)]
    outside = ["pvc-9x/keep", "pvc-90/keep", "other/pvc-9/keep", "pvc-9"]
    for key in inside + outside:
        s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    controller_plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=volume.volume_id, secrets=secret))
    assert keys(s3, bucket) == set(outside)
    s3.put_object(Bucket=bucket, Key="old/pvc-1/.stoker-volume.json", Body=b'{"on_delete": "Delete"}')
    s3.put_object(Bucket=bucket, Key="old/pvc-1/shard", Body=b"x")
    controller_plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=f"{bucket}/old/pvc-1/", secrets=secret))
    assert keys(s3, bucket) == set(outside)  # an id of the older form, location from the secret
    # An id that names a prefix without our marker (e.g. a static volume) is never touched.
    controller_plugin.controller.DeleteVolume(pb.DeleteVolumeRequest(volume_id=f"{bucket}/other/", secrets=secret))
    assert keys(s3, bucket) == set(outside)


@pytest.mark.parametrize("volume_id", [
    "stoker1:p=vols%2Fpvc-1%2F",              # no bucket
    "stoker1:b=data&p=vols%2Fpvc-1",          # a prefix that is not a folder
    "stoker1:b=data&p=vols%2F%2Fpvc-1%2F",    # an empty segment
    "stoker1:b=data",                         # no prefix: the whole bucket is never a volume
    "pvc-1",                                  # neither form
])
def test_ids_this_controller_did_not_make_are_never_acted_on(volume_id):
    from csi.provision import delete_volume, split_volume_id

    assert split_volume_id(volume_id) is None
    assert delete_volume(volume_id, SECRETS) == 0  # nothing deleted, no store contacted


def test_create_and_validate_errors(controller_plugin, moto_server, bucket):
    secret = provisioner_secret(moto_server.endpoint)

    def code(call):
        with pytest.raises(grpc.RpcError) as info:
            call()
        return info.value.code(), info.value.details()

    assert code(lambda: create(controller_plugin, "", {"bucket": bucket}, secret))[0] == grpc.StatusCode.INVALID_ARGUMENT
    got = code(lambda: create(controller_plugin, "v", {}, secret))
    assert got[0] == grpc.StatusCode.INVALID_ARGUMENT and "bucket" in got[1]
    got = code(lambda: create(controller_plugin, "v", {"bucket": bucket, "onDelete": "Shred"}, secret))
    assert got[0] == grpc.StatusCode.INVALID_ARGUMENT and "onDelete" in got[1]
    got = code(lambda: create(controller_plugin, "v", {"bucket": "missing-bucket-x"}, secret))
    assert got[0] == grpc.StatusCode.NOT_FOUND
    block = pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume(),
                                access_mode=pb.VolumeCapability.AccessMode(mode=3))
    got = code(lambda: controller_plugin.controller.CreateVolume(pb.CreateVolumeRequest(
        name="v", volume_capabilities=[block], parameters={"bucket": bucket}, secrets=secret)))
    assert got[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert code(lambda: controller_plugin.controller.DeleteVolume(pb.DeleteVolumeRequest()))[0] == \
        grpc.StatusCode.INVALID_ARGUMENT
    ok = controller_plugin.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=f"{bucket}/v/", volume_capabilities=[READ_ONLY_MANY]))
    assert list(ok.confirmed.volume_capabilities) == [READ_ONLY_MANY]
    refused = controller_plugin.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id=f"{bucket}/v/", volume_capabilities=[block]))
    assert not refused.HasField("confirmed") and "block" in refused.message
    assert code(lambda: controller_plugin.controller.ValidateVolumeCapabilities(pb.ValidateVolumeCapabilitiesRequest(
        volume_id="not-ours", volume_capabilities=[READ_ONLY_MANY])))[0] == grpc.StatusCode.NOT_FOUND
    snapshot = controller_plugin.channel.unary_unary("/csi.v1.Controller/CreateSnapshot")
    assert code(lambda: snapshot(b""))[0] == grpc.StatusCode.UNIMPLEMENTED
    assert SECRETS["secretAccessKey"] not in controller_plugin.log()
