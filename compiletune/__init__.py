"""compiletune: PyTorch-native LLM fine-tuning whose memory savings and speed come from the compiler."""

__version__ = "0.1.0"
