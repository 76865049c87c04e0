"""``python -m tda_plugins.cli``: the ``tda`` command."""

from tda_plugins.cli.commands import main

raise SystemExit(main())
