"""plugserve's HTTP server: the aiohttp application, its handlers and the command line."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("plugserve")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
