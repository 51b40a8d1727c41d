"""A moto server that enforces IAM (every request signed by a known key and allowed by its policies),
with an administrator, a bucket holding a dataset, users with and without read access, an IAM role
for pods, and STS for web identities in front of it (tests/support/sts.py)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import boto3

from stoker.s3server import MotoServer

from .sts import WebIdentitySts

_ALLOW_ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
_READ = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"],
                                                "Resource": "*"}]}
_TRUST = {"Version": "2012-10-17", "Statement": [{
    "Effect": "Allow", "Action": "sts:AssumeRoleWithWebIdentity",
    "Principal": {"Federated": "arn:aws:iam::123456789012:oidc-provider/oidc.cluster.example"}}]}


@dataclass
class Guarded:
    endpoint: str
    admin: dict
    bucket: str = "guarded"
    dataset: dict[str, bytes] = field(default_factory=dict)
    reader: dict[str, str] = field(default_factory=dict)  # secret keys of a user who may read
    stranger: dict[str, str] = field(default_factory=dict)  # keys of a user with no policy
    role_arn: str = ""
    sts: WebIdentitySts | None = None

    def client(self, service: str):
        return boto3.client(service, endpoint_url=self.endpoint, region_name="us-east-1", **self.admin)

    def user(self, name: str, policy: dict | None) -> dict[str, str]:
        iam = self.client("iam")
        iam.create_user(UserName=name)
        if policy is not None:
            iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {"accessKeyId": key["AccessKeyId"], "secretAccessKey": key["SecretAccessKey"]}


def start_guarded() -> tuple[MotoServer, Guarded]:
    """Start it all; the caller stops the server (and the STS in `guarded.sts`)."""
    server = MotoServer(env={"INITIAL_NO_AUTH_ACTION_COUNT": "3"}).start()
    iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1")
    iam.create_user(UserName="admin")  # the three requests before IAM is enforced
    key = iam.create_access_key(UserName="admin")["AccessKey"]
    iam.put_user_policy(UserName="admin", PolicyName="all", PolicyDocument=json.dumps(_ALLOW_ALL))
    guarded = Guarded(server.endpoint, {"aws_access_key_id": key["AccessKeyId"],
                                        "aws_secret_access_key": key["SecretAccessKey"]})
    s3 = guarded.client("s3")
    s3.create_bucket(Bucket=guarded.bucket)
    guarded.dataset = {f"train/{i:02d}.bin": os.urandom(100_000 + 7919 * i) for i in range(6)}
    for name, body in guarded.dataset.items():
        s3.put_object(Bucket=guarded.bucket, Key=name, Body=body)
    guarded.reader = guarded.user("reader", _READ)
    guarded.stranger = guarded.user("stranger", None)
    iam = guarded.client("iam")
    guarded.role_arn = iam.create_role(RoleName="pod-reader", AssumeRolePolicyDocument=json.dumps(_TRUST))["Role"]["Arn"]
    iam.put_role_policy(RoleName="pod-reader", PolicyName="read", PolicyDocument=json.dumps(_READ))
    guarded.sts = WebIdentitySts(server.endpoint, key["AccessKeyId"], key["SecretAccessKey"]).__enter__()
    return server, guarded
