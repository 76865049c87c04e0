"""Work over the ranks of a data-parallel run: what the callbacks exchange between ranks
(``gather.py``), how ``tda`` spreads scoring, fitting and capture over a ``torchrun``
launch (``ranks.py``), and FSDP2's DTensors recognized without importing their module
(``dtensor.py``)."""
