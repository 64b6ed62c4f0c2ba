"""``python -m plugserve``: the ``plugserve`` command."""

from plugserve.server.cli import main

raise SystemExit(main())
