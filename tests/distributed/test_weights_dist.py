"""load_weights on 2 ranks (gloo): from a Hugging Face style sharded index, each rank reads only its
partition (the two ranks' reads add up to the stored bytes, about half each; stage 0 reads all),
the loaded state equals the file, and training afterwards matches plain PyTorch from the same
weights. One spawn runs every case.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from tests._support.engine import rank_config
from tests._support.launch import launch

pytestmark = pytest.mark.distributed

CASES = [  # name, stage, dtype, offload (optimizer and parameters)
    ("s3-fp32", 3, "fp32", "none"),
    ("s1-bf16", 1, "bf16", "none"),
    ("s3-fp32-nvme", 3, "fp32", "nvme"),
    ("s0-fp32", 0, "fp32", "none"),
]
STEPS = 2


def worker(rank: int, world_size: int, out_dir: str, root: str) -> dict:
    import infinity
    from infinity.io import SafetensorsFile
    from tests._support.engine import batches, engine_train, tiny_gpt

    read = {"n": 0}
    real_read_into = SafetensorsFile.read_into

    def counting_read_into(self, name, out, *, start_numel=0):
        read["n"] += out.numel() * out.element_size()
        return real_read_into(self, name, out, start_numel=start_numel)

    SafetensorsFile.read_into = counting_read_into
    out = {}
    for name, stage, dtype, offload in CASES:
        engine = infinity.initialize(tiny_gpt(seed=1), rank_config(root, name, rank, stage=stage, dtype=dtype,
                                                                 offload=offload))
        read["n"] = 0
        result = engine.load_weights(os.path.join(root, "weights"))
        bytes_read = read["n"]
        loaded = {k: v.detach().cpu().clone() for k, v in engine.full_state_dict().items()}
        losses = engine_train(engine, batches(STEPS, 1), rank=rank, world_size=world_size)
        final = {k: v.detach().cpu().clone() for k, v in engine.full_state_dict().items()}
        engine.close()
        out[name] = {"result": result, "bytes_read": bytes_read, "loaded": loaded,
                     "losses": losses, "final": final}
    return out


def _write_index(directory: pathlib.Path, sd: dict) -> int:
    """Two shard files and an index, as save_pretrained writes them; returns the stored bytes."""
    from safetensors.torch import save_file

    names = list(sd)
    shards = {"model-00001-of-00002.safetensors": names[:12],
              "model-00002-of-00002.safetensors": names[12:]}
    directory.mkdir()
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(directory / file))
    with open(directory / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: file for file, keys in shards.items()
                                                  for k in keys}}, f)
    return sum(v.numel() * v.element_size() for v in sd.values())


def test_each_rank_reads_its_half_and_trains_like_pytorch(tmp_path):
    pytest.importorskip("safetensors")
    import torch

    from tests._support.engine import assert_close_run, batches, reference_train, tiny_gpt

    source = tiny_gpt(seed=0)
    saved = {k: v.detach().clone() for k, v in source.state_dict().items()}
    stored = {k: v.contiguous() for k, v in saved.items() if k != "lm_head.weight"}  # tied
    total = _write_index(tmp_path / "weights", stored)
    results = launch(__file__, "worker", world_size=2, timeout_s=240,
                     args={"root": str(tmp_path)})
    for name, stage, dtype, _ in CASES:
        ref_losses, ref_state = reference_train(tiny_gpt(seed=0), batches(STEPS, 1),
                                                dtype=dtype, splits=2)
        reads = [r[name]["bytes_read"] for r in results]
        if stage == 0:  # every rank holds (and reads) everything
            assert reads == [total, total], (name, reads)
        else:
            assert sum(reads) == total, (name, reads, total)
            assert all(0.4 * total <= n <= 0.6 * total for n in reads), (name, reads, total)
        for r in results:
            assert r[name]["result"] == {"missing_keys": [], "unexpected_keys": []}
            for k, v in saved.items():
                assert torch.equal(r[name]["loaded"][k], v.float()), (name, k)
            assert_close_run(r[name]["losses"], r[name]["final"], ref_losses, ref_state, dtype)
