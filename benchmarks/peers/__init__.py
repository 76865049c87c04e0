"""Peer-library adapters for ``benchmarks/bench_peers.py``: one module per library, each
registering a :class:`~peers.base.PeerAdapter`, plus the shared workload and the exact
``torch.func`` reference."""
