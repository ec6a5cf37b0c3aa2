# The one place the version is written: pyproject.toml reads it (scikit-build-core's regex
# provider) and poolkeeper.__version__ imports it.
__version__ = "0.1.0"
