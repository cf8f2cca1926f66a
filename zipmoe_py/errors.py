"""The one exception type ZipMoE raises for problems a user can fix."""


class ZipMoEError(RuntimeError):
    """Bad input, a missing file or a broken install; the message names the culprit."""


class ZipMoELoadError(ZipMoEError, ValueError):
    """A model or context llama.cpp could not make, with llama.cpp's own reason. Also a ValueError,
    which is what llama-cpp-python raises there ("Failed to load model from file")."""
