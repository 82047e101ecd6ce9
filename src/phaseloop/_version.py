"""The package version (pyproject.toml's; tests/test_compat.py checks that they agree)."""

__version__ = "0.2.0"
