"""The operator's exception root (below fusecore.failures.StokerError)."""

from fusecore.failures import StokerError


class OperatorError(StokerError):
    """Every error the operator and the warm agent raise on purpose."""
