"""``python -m epserve`` is the ``epserve`` command."""

from epserve.deploy.cli import main

raise SystemExit(main())
