"""``hf_mhc.conversion.safetensors_stream``: sizes as ``--max-shard-size`` takes them, and safetensors files
written tensor by tensor from chunks, aligned whatever the dtypes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from hf_mhc.conversion import ConversionError
from hf_mhc.conversion.safetensors_stream import SafetensorsStreamWriter, TensorSpec, aligned_order, parse_size


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5 kb") == 1500 and parse_size("4096") == 4096
    assert parse_size(123) == 123
    for bad in ("", "5XB", "-1MB", "0"):
        with pytest.raises(ConversionError):
            parse_size(bad)


def test_stream_writer_aligns_mixed_dtypes(tmp_path):
    tensors = {
        "odd_bytes": torch.arange(3, dtype=torch.int8),
        "halves": torch.randn(3, 5).to(torch.bfloat16),
        "floats": torch.randn(7),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    specs = aligned_order(TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items())
    with SafetensorsStreamWriter(tmp_path / "mixed.safetensors", specs, metadata={"format": "pt"}) as writer:
        for spec in specs:
            tensor = tensors[spec.name]
            writer.write_tensor(spec.name, tensor.split(2) if tensor.dim() else [tensor])
    loaded = load_file(tmp_path / "mixed.safetensors")
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with pytest.raises(RuntimeError, match="wrote 8 bytes, declared 12"):
        with SafetensorsStreamWriter(tmp_path / "short.safetensors", [TensorSpec("x", torch.float32, (3,))]) as w:
            w.write_tensor("x", [torch.zeros(2)])
