"""The ``plugserve`` command's subcommands besides ``serve``: ``validate``, ``new``
(``scaffold``) and ``doctor``."""
