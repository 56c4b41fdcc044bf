"""Our safetensors reader/writer against the reference ``safetensors`` package, bytes compared."""

from __future__ import annotations

import json
import os

import pytest
import torch

from infinity.io import (INDEX_NAME, SafetensorsCheckpoint, SafetensorsError, SafetensorsFile,
                         write_safetensors)

st = pytest.importorskip("safetensors.torch")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float64]


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dtype in enumerate(DTYPES):
        shape = [(3, 5), (7,), (1,), (2, 3, 4), (1023,), ()][i]
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 100
        out[f"layer.{i}.weight"] = t.to(dtype)
    return out


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_reference_file_reads_back_whole_and_by_slice(tmp_path):
    tensors = _tensors()
    path = tmp_path / "ref.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    with SafetensorsFile(path) as f:
        assert f.metadata == {"format": "pt"}
        for name, ref in tensors.items():
            assert _equal(f.get(name), ref), name
        ref = tensors["layer.4.weight"]
        out = torch.empty(100, dtype=ref.dtype)
        f.read_into("layer.4.weight", out, start_numel=500)
        assert torch.equal(out, ref.view(-1)[500:600])


def test_our_file_loads_with_the_reference_reader(tmp_path):
    tensors = _tensors(1)
    path = tmp_path / "ours.safetensors"
    size = write_safetensors(path, tensors, metadata={"step": 3})
    assert size == os.path.getsize(path)
    loaded = st.load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name in tensors:
        assert _equal(loaded[name], tensors[name]), name
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_sharded_index_layout(tmp_path):
    tensors = _tensors(2)
    names = list(tensors)
    st.save_file({n: tensors[n] for n in names[:3]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    st.save_file({n: tensors[n] for n in names[3:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {n: f"model-0000{1 if i < 3 else 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert set(ckpt.entries) == set(names)
        for name in names:
            assert _equal(ckpt.get(name), tensors[name])


def test_truncated_file_is_detected_before_reading(tmp_path):
    path = tmp_path / "t.safetensors"
    st.save_file(_tensors(), str(path))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)
    with pytest.raises(SafetensorsError, match="truncated"):
        SafetensorsFile(path)


def test_garbage_and_missing_files_give_clear_errors(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(SafetensorsError, match="header length"):
        SafetensorsFile(bad)
    with pytest.raises(SafetensorsError, match="no such"):
        SafetensorsFile(tmp_path / "missing.safetensors")
    path = tmp_path / "ok.safetensors"
    write_safetensors(path, {"a": torch.zeros(4)})
    with SafetensorsFile(path) as f:
        with pytest.raises(SafetensorsError, match="no tensor named 'b'"):
            f.get("b")
        with pytest.raises(SafetensorsError, match=r"asked for \[2, 6\)"):
            f.read_into("a", torch.empty(4), start_numel=2)
        with pytest.raises(SafetensorsError, match="dtype"):
            f.read_into("a", torch.empty(4, dtype=torch.float64))


def test_writing_a_live_tensor_keeps_its_storage_resizable(tmp_path):
    """Stage 3 frees and re-grows parameter storage; saving one must not pin its size."""
    t = torch.arange(10, dtype=torch.float32)
    write_safetensors(tmp_path / "live.safetensors", {"t": t})
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(40)
    assert st.load_file(str(tmp_path / "live.safetensors"))["t"].tolist() == list(range(10))
