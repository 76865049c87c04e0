"""Live scoring during training: query gradients prepared once (``queries.py``) and each
step's examples scored against them as a capture consumer (``influence.py``)."""
