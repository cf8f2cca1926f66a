"""The one exception type ZipMoE raises for problems a user can fix."""


class ZipMoEError(RuntimeError):
    """Bad input, a missing file or a broken install; the message names the culprit."""
