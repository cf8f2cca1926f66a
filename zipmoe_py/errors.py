"""The one exception type ZipMoE raises for problems a user can fix."""


class ZipMoEError(RuntimeError):
    """Bad input, a missing file or a broken install; the message names the culprit."""


class ZipMoELoadError(ZipMoEError, ValueError):
    """A model or context llama.cpp could not make, with llama.cpp's own reason. Also a ValueError,
    which is what llama-cpp-python raises there ("Failed to load model from file")."""


# pip extras (pyproject.toml) and the modules that tell whether each is installed
EXTRA_MODULES = {"convert": ("torch", "transformers", "safetensors", "tokenizers")}


def require_extra(extra: str, what: str) -> None:
    """Raise ZipMoEError naming the pip extra to install when what (a command or a step) needs one that is
    missing: the runtime installs without torch and transformers."""
    import importlib.util

    missing = [m for m in EXTRA_MODULES[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise ZipMoEError(f"{what} needs {', '.join(missing)}, which this install lacks: install the "
                          f"'{extra}' extra (pip install 'zipmoe[{extra}]', or bash tools/setup.sh)")
