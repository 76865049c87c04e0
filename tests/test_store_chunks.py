"""Reading stored micro-batches into chunks: the shard file reader against safetensors'
own, the stacked shapes, and what a chunk costs in memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tda_plugins import CaptureEngine, LayerSelection
from tda_plugins.store import GradientStore, StoreError, StoreReader
from tda_plugins.store.codec import stacked_shape
from tda_plugins.store.shardfile import DTYPES, ShardFile
from tests.memory import peak_growth

gen = torch.Generator().manual_seed(0)


def _tensors() -> dict[str, torch.Tensor]:
    """One tensor of every dtype a store holds, of a few shapes."""
    values = torch.randn(4, 3, 5, generator=gen)
    return {
        **{f"float-{d}": values.to(d) for d in DTYPES.values() if d.is_floating_point},
        "int64": torch.randint(-(2**40), 2**40, (7, 2), generator=gen),
        "int32": torch.randint(-(2**20), 2**20, (6,), generator=gen, dtype=torch.int32),
        "empty": torch.zeros(0, 4),
    }


def test_the_shard_reader_reads_what_safetensors_wrote(tmp_path: Path) -> None:
    """Every dtype, shape and the metadata read back as safetensors' own reader gives them,
    into new tensors and into a strided view of a larger one, or one of another dtype."""
    path = tmp_path / "shard.safetensors"
    tensors = _tensors()
    save_file(tensors, path, metadata={"layers": "{}", "note": "x"})
    with safe_open(path, "pt") as f, ShardFile(path) as shard:
        assert shard.metadata == f.metadata()
        for key in tensors:
            expected = f.get_tensor(key)
            got = shard.read(key)
            assert got.dtype == expected.dtype and torch.equal(got, expected), key
        wide = torch.full((4, 6, 5), -1.0)
        shard.read_into("float-torch.float32", wide[:, 2:5])  # strided: rows of 6
        assert torch.equal(wide[:, 2:5], tensors["float-torch.float32"])
        assert torch.equal(wide[:, :2], torch.full((4, 2, 5), -1.0))
        as_fp64 = torch.empty(4, 3, 5, dtype=torch.float64)
        shard.read_into("float-torch.float32", as_fp64)
        assert torch.equal(as_fp64, tensors["float-torch.float32"].double())


def test_a_mapped_tensor_reads_the_file_without_writing_to_it(tmp_path: Path) -> None:
    """Memory-mapped tensors equal safetensors' own reads, stay valid after the shard is
    closed, and writing to one changes neither the file nor a later read."""
    path = tmp_path / "shard.safetensors"
    tensors = _tensors()
    save_file(tensors, path, metadata={"layers": "{}"})
    with ShardFile(path) as shard:
        mapped = {key: shard.mapped(key) for key in tensors}
    for key, expected in tensors.items():
        assert mapped[key].dtype == expected.dtype and torch.equal(mapped[key], expected), key
    before = path.read_bytes()
    mapped["int64"].fill_(7)
    assert path.read_bytes() == before
    with ShardFile(path) as shard:
        assert torch.equal(shard.read("int64"), tensors["int64"])


def test_a_damaged_shard_is_refused_with_its_name(tmp_path: Path) -> None:
    path = tmp_path / "shard.safetensors"
    save_file({"x": torch.arange(100.0)}, path, metadata={"layers": "{}"})
    with ShardFile(path) as shard:
        with pytest.raises(StoreError, match="holds no tensor 'y'"):
            shard.read("y")
        with pytest.raises(StoreError, match="has shape"):
            shard.read_into("x", torch.empty(99))
    data = path.read_bytes()
    path.write_bytes(data[:-8])  # the last tensor's bytes cut short
    with ShardFile(path) as shard, pytest.raises(StoreError, match="ends inside x"):
        shard.read("x")
    path.write_bytes(b"not a shard")
    with pytest.raises(StoreError, match="not a readable gradient shard"):
        ShardFile(path)


def test_stacked_shapes_pad_token_fields_to_the_longest() -> None:
    """Factors stack with their token axis padded to the longest micro-batch; dense
    gradients only along the examples; shapes that cannot stack are refused."""
    assert stacked_shape("token_factors", "a", [(3, 10, 6), (2, 7, 6)]) == (5, 10, 6)
    assert stacked_shape("embedding_factors", "ids", [(3, 10), (2, 12)]) == (5, 12)
    assert stacked_shape("dense", "values", [(3, 24), (2, 24)]) == (5, 24)
    with pytest.raises(ValueError, match="do not stack"):
        stacked_shape("dense", "values", [(3, 24), (2, 25)])
    with pytest.raises(ValueError, match="do not stack"):
        stacked_shape("token_factors", "g", [(3, 10, 6), (2, 10, 7)])


WIDTH, TOKENS, BATCH, MICRO_BATCHES = 512, 192, 8, 16


def _wide_store(path: Path) -> StoreReader:
    """``MICRO_BATCHES`` shards of per-token factors of one bias-free linear layer,
    ``(BATCH, TOKENS, WIDTH)`` fp32 inputs and output gradients each (6.3 MB a shard)."""
    torch.manual_seed(0)
    model = nn.Linear(WIDTH, WIDTH, bias=False)
    store = GradientStore(path, keep_tokens=True)
    with CaptureEngine(model, layers=LayerSelection("linear"), consumers=[store]) as engine:
        for step in range(MICRO_BATCHES):
            engine.set_example_ids(torch.arange(step * BATCH, (step + 1) * BATCH))
            model(torch.randn(BATCH, TOKENS, WIDTH)).pow(2).sum().backward()
            engine.optimizer_step()
        engine.end()
    return StoreReader(path)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="reads peak memory from /proc")
def test_a_chunk_of_many_shards_costs_its_own_size_in_memory(tmp_path: Path) -> None:
    """Reading 16 shards as one ~100 MB chunk raises the process's peak resident memory by
    about the chunk's size: each stored tensor goes straight into its rows of the chunk,
    and no shard's tensors, concatenation or memory-mapped pages are held beside it (that
    took twice the chunk)."""
    reader = _wide_store(tmp_path)
    chunk_bytes = sum(reader.layer_nbytes().values()) * reader.num_examples
    assert chunk_bytes > 90 * 2**20
    growth = peak_growth(
        f"from tda_plugins.store import StoreReader\nreader = StoreReader({str(tmp_path)!r})",
        "chunk = reader.load_all()",
    )
    assert 0.9 * chunk_bytes < growth < 1.2 * chunk_bytes, (growth, chunk_bytes)
