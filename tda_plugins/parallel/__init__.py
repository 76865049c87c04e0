"""Work over the ranks of a data-parallel run: what the callbacks exchange between ranks
(``gather.py``) and how ``tda`` spreads scoring, fitting and capture over a ``torchrun``
launch (``ranks.py``)."""
