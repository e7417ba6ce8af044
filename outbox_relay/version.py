"""The one version of the package, both programs and the wheel (pyproject.toml reads it)."""

__version__ = "0.1.0"
