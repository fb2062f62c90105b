"""mlcc: a multi-target LLM compiler and runtime built on Apache TVM."""

__version__ = "0.1.0"
