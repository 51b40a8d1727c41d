"""The root of Stoker's exception tree. Each layer has its own root below it (fusecore: the classes
here and in store.errors; csi.failures.DriverError; stoker_operator.failures.OperatorError), and a
class that callers may also catch as a builtin (ValueError, RuntimeError) derives from both."""


class StokerError(Exception):
    """Every error Stoker raises on purpose."""
