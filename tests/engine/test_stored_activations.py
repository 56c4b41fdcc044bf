"""Saved activations as shards of the tiered store ([Note: saved activations are shards of the
store] in infinity/zero/_stored_activations.py): ``activation_checkpointing.offload`` 'host',
'nvme', 'auto'.

References: plain PyTorch + torch.optim.AdamW without checkpointing (parity), the blocks' inputs
captured by a forward pre-hook of the test's own against the bytes of the swap files on disk, and
the bytes the checkpointed blocks save (b*s*h elements of fp32 per block), against the engine's
and the store's counters.
"""

from __future__ import annotations

import os

import pytest
import torch

import infinity
import infinity.zero._stored_activations as stored_module
from infinity.config import load_config
from infinity.errors import DiskSpaceError, SwapIOError, TierCapacityError
from infinity.models.gpt import GPTConfig
from infinity.tiers import Residency, Tier
from tests._support.engine import (assert_close_run, batches, engine_config, engine_train,
                                   offload_config, reference_train, tiny_gpt)
from tests._support.store import (pin_the_whole_arena, train_with_the_arena_pinned_in_backward,
                                  unpin_the_arena)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Block inputs of 16 KiB (8 x 16 x 32 fp32), four blocks: 64 KiB a step.
WIDE = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)
BATCH, SEQ = 8, 16
INPUT_BYTES = BATCH * SEQ * WIDE.n_embd * 4
STEPS = 3


@pytest.fixture(autouse=True)
def _store_every_block_input(monkeypatch):
    # The engine's floor keeps tensors under 64 KiB where torch keeps them; these models are small.
    monkeypatch.setattr(stored_module, "MIN_STORED_BYTES", 4096)


def _model():
    return tiny_gpt(config=WIDE)


def _data(steps=STEPS, gas=1):
    return batches(steps, gas, BATCH, SEQ, config=WIDE)


def _acts(mode, **extra):
    return {"units": "all", "offload": mode, **extra}


def _config(tmp_path, mode, *, states, host, gas=1):
    """Activations offloaded ``mode``; ``states``: parameters and optimizer on NVMe too (one
    store for all), or nothing else offloaded (a store of the activations' own)."""
    swap = str(tmp_path / "swap")
    if states:
        return offload_config(swap, stage=3, gas=gas, opt="nvme", param="nvme", host=host,
                              activation_checkpointing=_acts(mode))
    return engine_config(stage=3, gas=gas, memory={"host_budget_bytes": host},
                         activation_checkpointing=_acts(mode, nvme_path=swap))


@pytest.mark.parametrize("states", [False, True], ids=["activations-alone", "with-states-on-nvme"])
@pytest.mark.parametrize("mode", ["host", "nvme", "auto"])
def test_parity_with_plain_pytorch(tmp_path, mode, states):
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    engine = infinity.initialize(_model(), _config(tmp_path, mode, states=states, host=4 << 20))
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    acts = engine.stats()["activations"]
    saved = acts["HOST"]["saved"] + acts["NVME"]["saved"]
    assert saved == STEPS * WIDE.n_layer * INPUT_BYTES  # every block input, once a step
    assert acts["HOST"]["current"] == acts["NVME"]["current"] == 0  # all used and freed
    home = {"host": "HOST", "nvme": "NVME", "auto": "HOST"}[mode]  # 'auto': the arena has room
    assert acts[home]["saved"] == saved
    assert acts[home]["peak"] == WIDE.n_layer * INPUT_BYTES  # one step's inputs at once
    engine.close()


@pytest.mark.parametrize("gas", [1, 2])
def test_a_host_budget_smaller_than_the_activations_reads_them_back_from_disk(tmp_path, gas):
    """64 KiB of block inputs a step through a 24 KiB arena: written once each, read back from
    the swap files (not the arena's cache), and training equals plain PyTorch."""
    data = _data(gas=gas)
    ref_losses, ref_state = reference_train(_model(), data)
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=24 << 10,
                                                   gas=gas))
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    acts = engine.stats()["activations"]
    saved = STEPS * gas * WIDE.n_layer * INPUT_BYTES
    assert acts["NVME"]["saved"] == saved
    assert acts["nvme_written_bytes"] == saved  # each saved byte written once
    # Read at most once; the arena holds at most one input beside one in flight, so at least
    # half of them came back from disk.
    assert saved // 2 <= acts["nvme_read_bytes"] <= saved
    assert engine.stats()["bytes"]["HOST"]["peak"] <= 24 << 10
    assert engine.store.swapper.keys() == []  # every file removed once read
    engine.close()


def test_the_swap_files_hold_the_block_inputs(tmp_path):
    """After a forward, before its backward: each block's input, captured by the test's own
    hook, is the payload of one swap file on disk."""
    model = _model()
    inputs = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().clone()))
    engine = infinity.initialize(model, _config(tmp_path, "nvme", states=False, host=8 << 20))
    (x, y), = _data(1)[0]
    loss = engine(x, y)
    engine.store.flush()  # written behind: wait for the writes
    swapper = engine.store.swapper
    on_disk = []
    for key in sorted(swapper.keys(), key=lambda k: int(k.split("/")[1])):
        with open(swapper.path_of(key), "rb") as f:
            data = f.read()[swapper.header_bytes:swapper.header_bytes + INPUT_BYTES]
        on_disk.append(torch.frombuffer(bytearray(data), dtype=torch.float32))
    assert len(on_disk) == WIDE.n_layer
    for captured, disk in zip(inputs, on_disk):
        assert torch.equal(captured.reshape(-1), disk)
    engine.backward(loss)
    engine.step()
    engine.close()


def test_auto_fills_the_arena_then_goes_to_nvme(tmp_path):
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    # Two 16 KiB inputs homed in a 68 KiB arena leave it the room of two more to stage the
    # other two through on their way to NVMe and back.
    engine = infinity.initialize(_model(), _config(tmp_path, "auto", states=False, host=68 << 10))
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    acts = engine.stats()["activations"]
    assert acts["HOST"]["saved"] == acts["NVME"]["saved"] == STEPS * 2 * INPUT_BYTES
    engine.close()


def test_a_forward_without_backward_leaves_nothing_behind(tmp_path):
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=8 << 20))
    (x, y), = _data(1)[0]
    loss = engine(x, y)
    assert engine.stats()["activations"]["NVME"]["current"] == WIDE.n_layer * INPUT_BYTES
    del loss  # the graph, and with it the saved inputs, dropped unused
    engine.finish_step()
    assert engine.stats()["activations"]["NVME"]["current"] == 0
    engine.store.flush()
    assert engine.store.swapper.keys() == [] and engine.store.keys() == []
    # and training goes on, equal to plain PyTorch
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    engine.close()
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=8 << 20))
    loss = engine(x, y)
    del loss
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    engine.close()


def test_host_offload_that_does_not_fit_names_the_way_out(tmp_path):
    engine = infinity.initialize(_model(), _config(tmp_path, "host", states=False, host=20 << 10))
    (x, y), = _data(1)[0]
    with pytest.raises(TierCapacityError, match=r"offload 'host'.*'nvme' or 'auto'"):
        engine(x, y)
    engine.close()


def test_a_full_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=8 << 20))
    real = stored_module.shutil.disk_usage
    monkeypatch.setattr(stored_module.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=1 << 20))
    (x, y), = _data(1)[0]
    with pytest.raises(DiskSpaceError, match=r"activation_checkpointing.nvme_path"):
        engine(x, y)
    assert os.listdir(engine.store.swapper.directory) == []
    engine.close()


@pytest.mark.parametrize("section, match", [
    ({"units": "all", "offload": "disk"}, r"activation_checkpointing.offload"),
    ({"units": "none", "offload": "nvme", "nvme_path": "/tmp/x"},
     r"activation_checkpointing.offload: .*units"),
    ({"units": "all", "offload": "nvme"}, r"activation_checkpointing.nvme_path"),
    ({"units": "all", "offload": "nvme", "offload_to_host": True},
     r"activation_checkpointing.offload_to_host"),
])
def test_config_errors_name_the_key(section, match):
    with pytest.raises(ValueError, match=match):
        load_config({"activation_checkpointing": section})


def test_one_swap_directory_per_process(tmp_path):
    with pytest.raises(ValueError, match=r"activation_checkpointing.nvme_path.*one swap directory"):
        load_config({"offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "a")},
                     "zero": {"stage": 3},
                     "activation_checkpointing": {"units": "all", "offload": "nvme",
                                                  "nvme_path": str(tmp_path / "b")}})
    cfg = load_config({"offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "a")},
                       "activation_checkpointing": {"units": "all", "offload": "nvme"}})
    assert load_config(cfg.to_dict()) == cfg


def test_a_tensor_larger_than_a_chunk_is_stored_in_chunks(tmp_path, monkeypatch):
    """[Note: chunks]: 4 KiB shards, four to an input; read back whole from disk through an arena
    too small for one input beside the states' copies."""
    monkeypatch.setattr(stored_module, "CHUNK_BYTES", 4096)
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=12 << 10))
    keys = []
    real_register = engine.store.register
    monkeypatch.setattr(engine.store, "register",
                        lambda key, *a, **k: (keys.append(key), real_register(key, *a, **k))[1])
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    assert keys[:4] == ["act/0/0", "act/0/1", "act/0/2", "act/0/3"]
    assert len(keys) == STEPS * WIDE.n_layer * INPUT_BYTES // 4096
    acts = engine.stats()["activations"]
    assert acts["nvme_written_bytes"] == acts["NVME"]["saved"] == STEPS * WIDE.n_layer * INPUT_BYTES
    assert acts["nvme_read_bytes"] > 0
    engine.close()


def test_no_room_to_stage_keeps_the_tensor_and_says_so(tmp_path, monkeypatch, caplog):
    """[Note: no room is not an error]: an arena that cannot stage one chunk on its way to NVMe
    leaves the inputs where torch keeps them, counted and warned about; training is unchanged."""
    monkeypatch.setattr(stored_module, "CHUNK_BYTES", 16 << 10)
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=8 << 10))
    with caplog.at_level("WARNING", logger="infinity.zero._stored_activations"):
        losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    acts = engine.stats()["activations"]
    assert acts["no_room_bytes"] == STEPS * WIDE.n_layer * INPUT_BYTES
    assert acts["NVME"]["saved"] == 0 and engine.store.keys() == []
    assert sum("found no room in the host arena" in r.message for r in caplog.records) == 1
    engine.close()


def test_auto_keeps_what_the_device_has_room_for_first(tmp_path):
    """'auto' on a device with room for two inputs ([Note: the device's room], the GPU's free
    memory standing in): two stay where torch keeps them, the others go to the arena; each
    tier's bytes come back to zero once the backward used them."""
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    engine = infinity.initialize(_model(), _config(tmp_path, "auto", states=False, host=4 << 20))
    stored = engine.stored_activations
    stored.device_room = lambda: 2 * INPUT_BYTES - stored.live_bytes[Tier.DEVICE]
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    acts = engine.stats()["activations"]
    assert acts["DEVICE"]["saved"] == acts["HOST"]["saved"] == STEPS * 2 * INPUT_BYTES
    assert acts["DEVICE"]["peak"] == 2 * INPUT_BYTES
    assert acts["DEVICE"]["current"] == acts["HOST"]["current"] == 0
    engine.close()


def _forward_then_break_a_file(tmp_path, damage):
    """A forward whose block inputs are on disk only (a 24 KiB arena), then ``damage`` applied to
    the first block's first swap file; returns the engine and the loss to backward."""
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=24 << 10))
    engine_train(engine, _data(1))  # a step first: the error must name the second one
    (x, y), = _data(1)[0]
    loss = engine(x, y)
    engine.store.flush()
    first = min(engine.store.swapper.keys(), key=lambda k: int(k.split("/")[1]))
    assert engine.store.state(first, Tier.HOST) is Residency.ABSENT  # read from the file
    damage(engine.store.swapper.path_of(first), engine.store.swapper.header_bytes)
    return engine, loss, first


@pytest.mark.parametrize("damage", ["corrupted", "cut-short"])
def test_a_damaged_swap_file_stops_the_backward_naming_module_step_and_file(tmp_path, damage):
    def corrupt(path, header):
        with open(path, "r+b") as f:
            f.seek(header + 100)
            f.write(bytes(range(64)))

    def cut(path, header):
        os.truncate(path, header + 1000)

    engine, loss, key = _forward_then_break_a_file(
        tmp_path, corrupt if damage == "corrupted" else cut)
    with pytest.raises(SwapIOError) as caught:
        engine.backward(loss)
    message = str(caught.value)
    assert "'blocks.0'" in message and "micro-step 1" in message and key in message
    assert engine.store.swapper.path_of(key) in message
    if damage == "corrupted":
        assert "word sum differs" in message


@pytest.mark.parametrize("mode", ["host", "nvme"])
def test_stage_0_parity(tmp_path, mode):
    data = _data(gas=2)
    ref_losses, ref_state = reference_train(_model(), data)
    cfg = engine_config(stage=0, gas=2, memory={"host_budget_bytes": 1 << 20},
                        activation_checkpointing=_acts(mode, nvme_path=str(tmp_path / "swap")))
    engine = infinity.initialize(_model(), cfg)
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    assert engine.stats()["activations"][mode.upper()]["saved"] == 2 * STEPS * WIDE.n_layer * INPUT_BYTES
    engine.close()


def test_an_evaluation_forward_between_steps_saves_nothing(tmp_path):
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=8 << 20))
    (x, y), = data[0]
    losses = []
    for step in data:
        losses += engine_train(engine, [step])
        saved = engine.stats()["activations"]["NVME"]["saved"]
        with torch.no_grad():
            engine.module.eval()
            engine(x, y)
            engine.module.train()
        assert engine.stats()["activations"]["NVME"]["saved"] == saved
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    engine.close()


class _LoopedGPT(torch.nn.Module):
    """WIDE's GPT whose blocks run twice in each forward: every unit saves two inputs a step."""

    def __init__(self):
        super().__init__()
        self.gpt = _model()

    def forward(self, idx, targets):
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1], device=idx.device))
        for _ in range(2):
            for block in g.blocks:
                x = block(x)
        logits = g.lm_head(g.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)),
                                                 targets.view(-1))


def test_a_unit_used_twice_in_one_forward(tmp_path):
    data = _data()
    ref_losses, ref_state = reference_train(_LoopedGPT(), data)
    engine = infinity.initialize(_LoopedGPT(), _config(tmp_path, "nvme", states=False,
                                                       host=24 << 10))
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    acts = engine.stats()["activations"]
    assert acts["NVME"]["saved"] == STEPS * 2 * WIDE.n_layer * INPUT_BYTES
    assert acts["nvme_read_bytes"] > 0
    engine.close()


def test_auto_goes_to_nvme_when_the_arena_has_the_room_only_in_pieces(tmp_path, monkeypatch):
    """'auto' chose the arena (its reclaimable bytes sufficed) but no hole held a chunk: the
    input goes to NVMe instead, and training is unchanged."""
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    engine = infinity.initialize(_model(), _config(tmp_path, "auto", states=False, host=4 << 20))
    store, real = engine.store, engine.store.register

    def register(key, numel, dtype, home, **kw):
        if key.startswith("act/") and home is Tier.HOST:
            raise TierCapacityError("fragmented (test)", tier="HOST", requested_bytes=numel,
                                    used_bytes=0, budget_bytes=4 << 20)
        return real(key, numel, dtype, home, **kw)

    monkeypatch.setattr(store, "register", register)
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    acts = engine.stats()["activations"]
    assert acts["HOST"]["saved"] == 0 and acts["NVME"]["saved"] == STEPS * WIDE.n_layer * INPUT_BYTES
    engine.close()


def test_a_read_back_without_room_lets_its_reads_ahead_go_and_reads_again(tmp_path, monkeypatch):
    """The blocking read of a saved input finds the arena pinned full once: the reads issued
    ahead are let go and the read is tried again; training is unchanged."""
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=64 << 10))
    store, real = engine.store, engine.store.acquire
    refused: list[str] = []

    def acquire(key, tier, **kw):
        if key.startswith("act/") and not kw.get("ahead") and len(refused) < 2 \
                and key not in refused:
            refused.append(key)
            raise TierCapacityError("pinned full (test)", tier="HOST", requested_bytes=1,
                                    used_bytes=0, budget_bytes=64 << 10)
        return real(key, tier, **kw)

    monkeypatch.setattr(store, "acquire", acquire)
    losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    assert len(refused) == 2
    assert engine.stats()["activations"]["NVME"]["current"] == 0
    assert [k for k in store.keys() if k.startswith("act/")] == []  # every pin released, freed
    engine.close()


def test_a_read_back_that_finds_no_room_twice_reads_outside_the_arena(tmp_path, monkeypatch,
                                                                       caplog):
    """[Note: no room to read back is not an error]: every blocking read of a saved input
    finds the arena pinned full, reads ahead let go or not: each chunk is read outside the
    arena, counted and warned about once; training equals plain PyTorch."""
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=64 << 10))
    store, real = engine.store, engine.store.acquire

    def acquire(key, tier, **kw):
        if key.startswith("act/") and not kw.get("ahead"):
            raise TierCapacityError("pinned full (test)", tier="HOST", requested_bytes=1,
                                    used_bytes=0, budget_bytes=64 << 10)
        return real(key, tier, **kw)

    monkeypatch.setattr(store, "acquire", acquire)
    with caplog.at_level("WARNING", logger="infinity.zero._stored_activations"):
        losses = engine_train(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    acts = engine.stats()["activations"]
    # The first unpack of each step has no read ahead to wait for: its chunk at least.
    assert STEPS * INPUT_BYTES <= acts["over_budget_read_bytes"] <= acts["NVME"]["saved"]
    assert sum("had no room to read back" in r.message for r in caplog.records) == 1
    assert acts["NVME"]["current"] == 0 and store.keys() == []  # every pin released, freed
    engine.close()


def test_a_backward_with_every_arena_extent_pinned_reads_outside_the_arena(tmp_path):
    """No fake: between each forward and its backward the test pins every extent of the arena
    (the cached copies of the saved inputs evicted for it). Every input comes back from its
    file outside the arena, and training equals plain PyTorch."""
    data = _data()
    ref_losses, ref_state = reference_train(_model(), data)
    engine = infinity.initialize(_model(), _config(tmp_path, "nvme", states=False, host=64 << 10))
    store = engine.store
    losses = train_with_the_arena_pinned_in_backward(engine, data)
    assert_close_run(losses, engine.full_state_dict(), ref_losses, ref_state, "fp32")
    acts = engine.stats()["activations"]
    saved = STEPS * WIDE.n_layer * INPUT_BYTES
    assert acts["NVME"]["saved"] == acts["over_budget_read_bytes"] == saved
    assert acts["nvme_read_bytes"] == saved  # each from its file, once, counted as a read
    assert acts["NVME"]["current"] == 0 and store.keys() == []
    engine.close()


def test_a_damaged_file_read_outside_the_arena_still_stops_the_backward(tmp_path):
    """[Note: activations are checked when read back] holds for the read outside the arena."""
    def corrupt(path, header):
        with open(path, "r+b") as f:
            f.seek(header + 100)
            f.write(bytes(range(64)))

    engine, loss, key = _forward_then_break_a_file(tmp_path, corrupt)
    pins = pin_the_whole_arena(engine.store)
    with pytest.raises(SwapIOError) as caught:
        engine.backward(loss)
    message = str(caught.value)
    assert "'blocks.0'" in message and "micro-step 1" in message and key in message
    assert engine.store.swapper.path_of(key) in message and "word sum differs" in message
    assert engine.stored_activations.over_budget_read_bytes > 0
    unpin_the_arena(engine.store, pins)
