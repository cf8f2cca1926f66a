"""The one exception type ZipMoE raises for problems a user can fix."""


class ZipMoEError(RuntimeError):
    """Bad input, a missing file or a broken install; the message names the culprit."""


class ZipMoEWarning(UserWarning):
    """Something the user asked for that the load did not do as asked (a budget reduced to fit, an
    option that does nothing): the loader's own words, raised as a warning even with verbose=False."""


class OptionsIgnoredWarning(ZipMoEWarning):
    """ZipMoE options given for a GGUF that is not a ZipMoE GGUF; kwargs names them (zipmoe_budget, ...)
    so that each surface can say them as its user gave them."""

    def __init__(self, model_path, kwargs):
        self.model_path, self.kwargs = str(model_path), tuple(kwargs)
        super().__init__(self.worded(self.kwargs))

    def worded(self, names) -> str:
        """The warning with the options named as the caller's surface names them (--budget)."""
        verb = "does" if len(names) == 1 else "do"
        return (f"{self.model_path} is not a ZipMoE GGUF: {', '.join(names)} {verb} nothing; convert it with "
                "zipmoe-convert to serve its experts under a budget")


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
