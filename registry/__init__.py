"""plugserve's registry: plugin discovery, versions, lifecycle and the route table.

Plugin authors need only :mod:`plugserve.registry.hookspecs` (and not even that: pluggy's
``HookimplMarker("plugserve")`` is the same marker).
"""
