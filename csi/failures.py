"""The CSI driver's exception root (below fusecore.failures.StokerError): attribute problems, mount
failures and the CSI contract's errors (errors.py) all derive from it; errors.py maps them to gRPC."""

from fusecore.failures import StokerError


class DriverError(StokerError):
    """Every error the CSI driver raises on purpose."""
