"""``python -m tda_plugins``: the ``tda`` command (as ``python -m tda_plugins.cli``)."""

from tda_plugins.cli.commands import main

raise SystemExit(main())
