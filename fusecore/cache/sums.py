"""Checksums of block bytes, by name: CRC64-NVME (S3's own default object checksum, through awscrt's
hardware-accelerated implementation: ~11 GiB/s here, a tenth of SHA-256's cost) and SHA-256.

They catch corrupted bytes and a wrong block; none is a signature (whoever can change the bytes can change
their checksum)."""

from __future__ import annotations

import hashlib

from awscrt.checksums import crc64nvme

from .memory import Buffer


def _crc64nvme(data: Buffer) -> bytes:
    return crc64nvme(data).to_bytes(8, "big")


def _sha256(data: Buffer) -> bytes:
    return hashlib.sha256(data).digest()


CHECKSUMS = {"crc64nvme": _crc64nvme, "sha256": _sha256}
