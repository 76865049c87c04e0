"""Small helpers shared by several rooms: the named-strategy registry (``registry.py``),
end-of-run progress bars (``progress.py``) and returning freed heap memory to the
operating system (``heap.py``)."""
