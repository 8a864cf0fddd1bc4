"""compiletune: PyTorch-native LLM fine-tuning whose memory savings and speed come from the compiler."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("compiletune")  # declared once, in pyproject.toml
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
