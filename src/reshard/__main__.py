"""``python -m reshard`` is the ``reshard`` command."""

from reshard.cli import main

raise SystemExit(main())
