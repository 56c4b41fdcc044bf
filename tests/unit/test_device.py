"""Device choice, input placement and process-group set-up as pure logic (issue #14, defects 1-3):
[Note: one rank per device] in infinity/zero/_device.py, [Note: the engine moves inputs] in
infinity/zero/_inputs.py. No GPU needed: device counts are arguments, the moves go to ``meta``
(a real device change on a CPU machine), and torch.distributed's calls are recorded."""

from __future__ import annotations

import collections
import dataclasses
import types
from collections import OrderedDict, UserDict

import pytest
import torch

from infinity.zero import _collectives
from infinity.zero._device import choose_device
from infinity.zero._inputs import move_to_device



def _torchrun(local_rank: int, local_world: int, **extra: str) -> dict[str, str]:
    return {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world), **extra}


# ------------------------------------------------------------------------- device choice
@pytest.mark.parametrize("requested", ["cpu", "auto"])
def test_cpu_without_gpus(requested):
    assert choose_device(requested, env=_torchrun(3, 4), device_count=0) == torch.device("cpu")


def test_cpu_stays_cpu_with_gpus():
    assert choose_device("cpu", env=_torchrun(1, 2), device_count=2) == torch.device("cpu")


@pytest.mark.parametrize("requested", ["auto", "cuda"])
def test_each_local_rank_takes_its_own_gpu(requested):
    """torchrun, 4 ranks on 4 GPUs: rank r on cuda:r; 'cuda' gets its index filled in (a bare
    torch.device('cuda') made torch.cuda.set_device raise)."""
    got = [choose_device(requested, env=_torchrun(r, 4), device_count=4) for r in range(4)]
    assert got == [torch.device("cuda", r) for r in range(4)]


def test_single_process_takes_gpu_0():
    assert choose_device("auto", env={}, device_count=8) == torch.device("cuda", 0)
    assert choose_device("cuda", env={}, device_count=8) == torch.device("cuda", 0)


def test_per_process_visible_device_is_cuda_0():
    """SLURM / a launcher that sets CUDA_VISIBLE_DEVICES per process: each sees one GPU, so the
    raw LOCAL_RANK (3) is not a valid index; LOCAL_RANK % 1 is."""
    env = _torchrun(3, 4, CUDA_VISIBLE_DEVICES="3")
    assert choose_device("auto", env=env, device_count=1) == torch.device("cuda", 0)
    assert choose_device("cuda:0", env=env, device_count=1) == torch.device("cuda", 0)


def test_two_local_ranks_on_one_visible_gpu_is_refused():
    """One GPU on the node (CUDA_VISIBLE_DEVICES unset), 2 local ranks: both would use it."""
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=2 .*1 GPU.*nproc_per_node 1"):
        choose_device("auto", env=_torchrun(1, 2), device_count=1)


def test_more_local_ranks_than_gpus_is_refused():
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=4 .*2 GPU.*share GPU 1"):
        choose_device("auto", env=_torchrun(3, 4, CUDA_VISIBLE_DEVICES="0,1"), device_count=2)


def test_fixed_index_under_multi_rank_launch_is_refused():
    """'cuda:0' under torchrun with 2 GPUs put every rank on GPU 0."""
    with pytest.raises(ValueError, match=r"'cuda:0' with LOCAL_WORLD_SIZE=2 .*'auto' or 'cuda'"):
        choose_device("cuda:0", env=_torchrun(1, 2), device_count=2)


def test_fixed_index_single_process_is_kept():
    assert choose_device("cuda:1", env={}, device_count=2) == torch.device("cuda", 1)


def test_index_beyond_visible_gpus_is_refused():
    with pytest.raises(ValueError, match=r"'cuda:2' but this process sees 2 GPU"):
        choose_device("cuda:2", env={}, device_count=2)


def test_cuda_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA is not available"):
        choose_device("cuda", env={}, device_count=0)


def test_bad_local_rank_names_the_variable():
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        choose_device("auto", env={"LOCAL_RANK": "x"}, device_count=2)


def test_config_rejects_malformed_cuda_device():
    import infinity

    with pytest.raises(ValueError, match="device"):
        infinity.load_config({"device": "cuda:x"})
    assert infinity.load_config({"device": "cuda:1"}).device == "cuda:1"


# ------------------------------------------------------------------------- inputs
META = torch.device("meta")
Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor | None = None
    name: str = "b"


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    input_ids: torch.Tensor


class Encoding(UserDict):
    """Like transformers' BatchEncoding: a UserDict with state of its own."""

    def __init__(self, data=None, note="n"):
        super().__init__(data)
        self.note = note


class Output(OrderedDict):
    """Like transformers' ModelOutput: an OrderedDict whose items mirror attributes."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        setattr(self, key, value)


def test_moves_tensors_nested_in_containers():
    t = torch.ones(2)
    out = Output()
    out["logits"] = t
    obj = {"a": [t, (t, 3)], "pair": Pair(t, "s"), "batch": Batch(t, None), "frozen": FrozenBatch(t),
           "enc": Encoding({"input_ids": t}, note="kept"), "out": out, "n": 7, "s": "text"}
    got = move_to_device(obj, META)
    assert got["a"][0].device == META and got["a"][1][0].device == META and got["a"][1][1] == 3
    assert isinstance(got["a"][1], tuple)
    assert type(got["pair"]) is Pair and got["pair"].x.device == META and got["pair"].y == "s"
    assert type(got["batch"]) is Batch and got["batch"].input_ids.device == META
    assert got["batch"].labels is None and got["batch"].name == "b"
    assert type(got["frozen"]) is FrozenBatch and got["frozen"].input_ids.device == META
    assert type(got["enc"]) is Encoding and got["enc"]["input_ids"].device == META
    assert got["enc"].note == "kept"
    assert type(got["out"]) is Output and got["out"].logits.device == META
    assert got["n"] == 7 and got["s"] == "text"
    # The caller's objects are left as they were.
    assert obj["batch"].input_ids.device.type == "cpu" and obj["enc"]["input_ids"].device.type == "cpu"
    assert out.logits.device.type == "cpu"


def test_nothing_to_move_returns_the_same_objects():
    t = torch.ones(2)
    obj = ({"x": t, "n": 1}, [t], Batch(t))
    got = move_to_device(obj, torch.device("cpu"))
    assert got is obj and got[0] is obj[0] and got[2] is obj[2]


def test_read_only_mapping_becomes_a_dict():
    got = move_to_device(types.MappingProxyType({"x": torch.ones(1)}), META)
    assert got["x"].device == META


def test_tensor_on_the_device_is_not_copied():
    t = torch.ones(2, device=META)
    assert move_to_device(t, META) is t


# ------------------------------------------------------------------------- process group
@pytest.fixture
def recorded_dist(monkeypatch):
    """torch.distributed and torch.cuda.set_device replaced by recorders; a torchrun environment."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(_collectives, "is_distributed", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(_collectives.dist, "init_process_group",
                        lambda **kw: calls.append(("init_process_group", kw)))
    return calls


def test_nccl_group_is_created_after_set_device_with_device_id(recorded_dist):
    """Defect 3: set_device came after init_process_group, and no device_id was passed."""
    device = torch.device("cuda", 1)
    assert _collectives.init_from_env_if_launched(device)
    assert recorded_dist == [("set_device", device),
                             ("init_process_group", {"backend": "nccl", "device_id": device})]


def test_gloo_group_on_cpu_is_unchanged(recorded_dist):
    assert _collectives.init_from_env_if_launched(torch.device("cpu"))
    assert recorded_dist == [("init_process_group", {"backend": "gloo"})]


def test_existing_group_still_binds_the_device(recorded_dist, monkeypatch):
    """A script that made its own group: the engine still sets this rank's device."""
    monkeypatch.setattr(_collectives, "is_distributed", lambda: True)
    assert not _collectives.init_from_env_if_launched(torch.device("cuda", 1))
    assert recorded_dist == [("set_device", torch.device("cuda", 1))]


def test_barrier_names_the_device_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(_collectives, "is_distributed", lambda: True)
    monkeypatch.setattr(_collectives.dist, "barrier", lambda **kw: calls.append(kw))
    _collectives.barrier(torch.device("cuda", 3))
    _collectives.barrier(torch.device("cpu"))
    assert calls == [{"device_ids": [3]}, {}]


def test_init_distributed_resolves_binds_then_creates(recorded_dist, monkeypatch):
    """The example's entry: LOCAL_RANK 1 of 2 on a 2-GPU node binds cuda:1 before the group."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _collectives.init_distributed() == torch.device("cuda", 1)
    assert [c[0] for c in recorded_dist] == ["set_device", "init_process_group"]
    assert recorded_dist[1][1]["device_id"] == torch.device("cuda", 1)
