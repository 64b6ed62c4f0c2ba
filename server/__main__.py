from plugserve.server.cli import main

raise SystemExit(main())
