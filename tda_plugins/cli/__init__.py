"""The ``tda`` command line (``commands.py``), its option value types
(``option_types.py``) and the models ``tda capture`` loads (``models.py``); run as ``tda``
or ``python -m tda_plugins.cli``."""

from tda_plugins.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
