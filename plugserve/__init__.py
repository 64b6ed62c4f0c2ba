"""plugserve, a plugin-based model server: one import namespace.

``plugserve.server`` (the repository's ``server/``: the HTTP and gRPC front ends, the
processes, the command line) and ``plugserve.registry`` (``registry/``: the plugin
contract, loading, scheduling and routing). The packaging maps those folders here
(``setup.cfg``); in a checkout, ``plugserve/server`` and ``plugserve/registry`` are links
to them, so the tree runs as installed.
"""

from plugserve.server import __version__

__all__ = ["__version__"]
