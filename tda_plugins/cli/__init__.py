"""The ``tda`` command line: its parser (``commands.py``, which imports no torch), the
options' value types and choices (``option_types.py``, ``choices.py``), what each command
does (``runs.py``) and the models ``tda capture`` loads (``models.py``); run as ``tda`` or
``python -m tda_plugins.cli``."""

from tda_plugins.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
