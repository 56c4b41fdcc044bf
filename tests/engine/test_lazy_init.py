"""``with infinity.init(config): model = build()``: lazy construction equals eager construction.

References: the same model built eagerly on the CPU from the same seed (every parameter and
buffer bitwise, the RNG state after construction), plain-PyTorch training of that eager model
(through the engine built from it), and the process's peak RSS measured in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import infinity
from infinity.models.gpt import GPT
from infinity.zero._lazy import LazyInitError, recording_of
from tests._support.engine import TINY, batches, engine_config, tiny_gpt


class Zoo(nn.Module):
    """Construction patterns that real models use, each drawing from the RNG."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)  # normal_ then a row zeroed via a view
        self.lin = nn.Linear(16, 24)  # kaiming_uniform_ + uniform_ bias
        self.norm = nn.LayerNorm(24)  # ones / zeros
        self.conv = nn.Conv1d(4, 8, 3)
        self.gru_like = nn.Parameter(torch.empty(8, 8))
        nn.init.orthogonal_(self.gru_like)  # returns early on meta tensors in torch
        self.scale = nn.Parameter(torch.randn(24) * 0.02)  # computed from another tensor
        self.fixed = nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))  # values given by the user
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight  # tied
        half = nn.Linear(4, 4)
        torch.set_default_dtype(torch.float64)
        self.wide = nn.Parameter(torch.rand(5))  # a factory under another default dtype
        torch.set_default_dtype(torch.float32)
        self.half = half
        inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.register_buffer("count", torch.zeros(3, dtype=torch.long))
        nn.init.trunc_normal_(self.lin.weight, std=0.02)  # a second init of the same weight
        self.apply(self._init_weights)  # a model's post-construction pass (HF post_init)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.normal_(module.bias, std=0.5)
        if isinstance(module, nn.Conv1d):
            nn.init.xavier_uniform_(module.weight)
            module.weight.data.mul_(0.5)  # the old-style in-place edit through .data


class CountDraws(TorchDispatchMode):
    """The reference for what construction draws: the elements that seeded-random aten ops
    (torch's own tag for ops that draw from a generator) fill while the mode is active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.numel += sum(t.numel() for t in tree_flatten(out)[0]
                              if isinstance(t, torch.Tensor))
        return out


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def _lazy_values(model: nn.Module) -> dict[str, torch.Tensor]:
    recording = recording_of(model)
    return {name: recording.value(t) if t.device.type == "meta" else t.detach()
            for name, t in _tensors(model).items()}


def _build_both(build, seed: int = 7):
    torch.manual_seed(seed)
    eager = build()
    after_eager = torch.randn(4)
    torch.manual_seed(seed)
    with infinity.init():
        lazy = build()
    after_lazy = torch.randn(4)
    return eager, lazy, after_eager, after_lazy


def test_construction_patterns_give_eager_values_and_rng_stream():
    eager, lazy, after_eager, after_lazy = _build_both(Zoo)
    assert torch.equal(after_eager, after_lazy), "the RNG must end where eager construction ends"
    assert lazy.lin.weight.device.type == "meta" and lazy.fixed.device.type == "cpu"
    assert lazy.head.weight is lazy.emb.weight
    got = _lazy_values(lazy)
    for name, ref in _tensors(eager).items():
        assert got[name].dtype == ref.dtype and got[name].shape == ref.shape, name
        assert torch.equal(got[name], ref.detach()), name
    assert torch.all(got["emb.weight"][0] == 0)
    assert got["wide"].dtype == torch.float64


def test_random_draws_on_real_tensors_inside_the_block_match_eager():
    def build():
        m = nn.Linear(8, 8)
        m.noise = torch.randn(3, device="cpu")  # a real draw between two lazy inits
        m.register_buffer("real", torch.randn(2, device="cpu"))
        m.extra = nn.Linear(8, 2)
        return m

    eager, lazy, _, _ = _build_both(build)
    assert torch.equal(eager.noise, lazy.noise) and torch.equal(eager.real, lazy.real)
    got = _lazy_values(lazy)
    for name, ref in _tensors(eager).items():
        assert torch.equal(got[name], ref.detach()), name


def test_transformers_models_match_eager():
    transformers = pytest.importorskip("transformers")
    configs = [transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2),
               transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                                       n_positions=32, bos_token_id=0, eos_token_id=0)]
    for cfg in configs:
        eager, lazy, after_eager, after_lazy = _build_both(
            lambda: transformers.AutoModelForCausalLM.from_config(cfg))
        assert torch.equal(after_eager, after_lazy)
        got = _lazy_values(lazy)
        for name, ref in _tensors(eager).items():  # non-persistent buffers (inv_freq) too
            assert torch.equal(got[name], ref.detach()), f"{type(lazy).__name__}: {name}"


@pytest.mark.parametrize("stage,offload", [(0, "none"), (3, "none"), (3, "cpu"), (3, "nvme")])
def test_engine_from_lazy_model_equals_engine_from_eager_model(tmp_path, stage, offload):
    """Same full state dict after initialize, then the same losses and parameters after
    training (bitwise: the same values go through the same engine)."""
    extra = {}
    if offload != "none":
        extra = {"offload_param": {"device": offload, "nvme_path": str(tmp_path)},
                 "offload_optimizer": {"device": offload, "nvme_path": str(tmp_path)}}
    config = engine_config(stage=stage, **extra)
    data = batches(3, 1)

    def run(model):
        engine = infinity.initialize(model, config)
        first = {k: v.clone() for k, v in engine.full_state_dict().items()}
        losses = []
        for step in data:
            loss = engine(*step[0])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        final = engine.full_state_dict()
        engine.close()
        return first, losses, final

    torch.manual_seed(0)
    with infinity.init(config):
        lazy = GPT(TINY)
    e_first, e_losses, e_final = run(tiny_gpt(0))
    l_first, l_losses, l_final = run(lazy)
    assert e_first.keys() == l_first.keys()
    for k in e_first:
        assert torch.equal(e_first[k], l_first[k]), k
    assert l_losses == e_losses
    for k in e_final:
        assert torch.equal(e_final[k], l_final[k]), k
    assert all(p.device.type == "cpu" for p in lazy.parameters())


def test_initialize_without_config_uses_the_blocks_config():
    config = engine_config(stage=3, dtype="bf16")
    with infinity.init(config):
        model = GPT(TINY)
    engine = infinity.initialize(model)
    try:
        assert engine.config.precision.dtype == "bf16" and engine.manager.stage == 3
    finally:
        engine.close()


def test_bad_use_raises_clear_errors():
    with pytest.raises(ValueError, match="offload_param.device"):  # config checked at the block
        with infinity.init({"zero": {"stage": 3}, "offload_param": {"device": "gpu"}}):
            pass
    with pytest.raises(LazyInitError, match="real"):
        with infinity.init():
            w = nn.Linear(4, 4).weight
            torch.zeros(4, 4, device="cpu").copy_(w)
    by_hand = nn.Linear(4, 4, device="meta")
    with pytest.raises(LazyInitError, match="'weight'.*not built under"):
        infinity.initialize(by_hand, engine_config(stage=3))
    with infinity.init():
        lazy = nn.Sequential(nn.Linear(4, 4))
    lazy.extra = nn.Linear(2, 2, device="meta")  # one stray meta tensor: the model is refused
    with pytest.raises(LazyInitError, match="extra.weight"):
        infinity.initialize(lazy, engine_config(stage=3))


_RSS_CHILD = textwrap.dedent("""
    import json, sys, tempfile
    import torch
    from torch import nn
    import infinity

    def status_mib(field):
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(field + ":"))
        return int(line.split()[1]) / 1024

    def peak_mib():
        return status_mib("VmHWM")

    class Adapted(nn.Module):
        \"\"\"A frozen base (what LoRA fine-tuning holds) and a small trainable head.\"\"\"
        def __init__(self, layers, width):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
            self.blocks.requires_grad_(False)
            self.head = nn.Linear(width, 8)
        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x).float().pow(2).mean()

    layers, width, lazy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "lazy"
    with infinity.init():  # torch's meta kernels import their Python modules once (~70 MiB)
        nn.Linear(2, 2)
    with open("/proc/self/clear_refs", "w") as f:  # the peak counts from here (Linux >= 4.0)
        f.write("5")
    base = status_mib("VmRSS")
    d = tempfile.mkdtemp()
    config = {"zero": {"stage": 3, "unit_class_names": ["Linear"]},
              "precision": {"dtype": "bf16"},
              "offload_param": {"device": "nvme", "nvme_path": d},
              "offload_optimizer": {"device": "cpu"},
              "memory": {"host_budget_bytes": 32 * 2**20, "device_budget_bytes": 32 * 2**20}}
    if lazy:
        with infinity.init(config):
            model = Adapted(layers, width)
    else:
        model = Adapted(layers, width)
    built = peak_mib()
    engine = infinity.initialize(model, config)
    loss = engine(torch.randn(2, width, dtype=torch.bfloat16))
    engine.backward(loss)
    engine.step()
    print(json.dumps({"base": base, "built": built, "peak": peak_mib(),
                      "finite": bool(torch.isfinite(loss))}))
    engine.close()
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak reset")
def test_lazy_construction_bounds_peak_host_memory(tmp_path):
    """A frozen base of N x 4 MiB units (fp32) plus a trainable head, parameters on NVMe with
    32 MiB budgets. Eagerly, construction alone holds the whole base. Built under infinity.init,
    construction holds nothing and the peak through initialize and one step does not grow with
    the model: a base four times larger (192 -> 768 MiB) adds less than a quarter of the added
    bytes (what varies is in-flight I/O and heap slack, tens of MiB)."""
    width = 1024
    script = tmp_path / "child.py"
    script.write_text(_RSS_CHILD)

    def run(mode, layers):
        out = subprocess.run([sys.executable, str(script), str(layers), str(width), mode],
                             capture_output=True, text=True, timeout=240,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["finite"]
        return got["built"] - got["base"], got["peak"] - got["base"]

    model_mib = 48 * (width * width + width) * 4 / 2**20
    eager_built, eager_peak = run("eager", 48)
    lazy_built, lazy_peak = run("lazy", 48)
    _, lazy_peak_large = run("lazy", 192)
    assert eager_built > 0.9 * model_mib, eager_built  # the reference holds the whole base
    assert lazy_built < 8, lazy_built  # meta tensors: no bytes
    assert lazy_peak < eager_peak, (lazy_peak, eager_peak)
    added_mib = 3 * model_mib
    assert lazy_peak_large - lazy_peak < 0.25 * added_mib, (lazy_peak, lazy_peak_large)


def test_meta_tensor_from_before_the_block_is_refused():
    early = nn.Linear(3, 3, device="meta")
    with infinity.init():
        for p in early.parameters():  # written inside the block, created before it
            nn.init.zeros_(p)
        model = nn.Sequential(early)
    with pytest.raises(LazyInitError, match="before the infinity.init block"):
        infinity.initialize(model, engine_config(stage=3))


def test_random_numel_counts_what_eager_construction_draws():
    """The reference: every seeded-random aten op eager construction runs, and the elements it
    fills (torch's own tag for ops that draw from a generator)."""
    def build():
        m = nn.Sequential(nn.Linear(30, 20), nn.Embedding(50, 8), nn.LayerNorm(8))
        nn.init.normal_(m[0].weight, std=0.02)  # drawn twice, as GPT's scaled projections are
        return m

    draws = CountDraws()
    with draws:
        build()
    with infinity.init() as recording:
        build()
    assert draws.numel == 30 * 20 * 2 + 20 + 50 * 8
    assert recording.random_numel == draws.numel


class Overwrites(nn.Module):
    """[Note: a whole overwrite ends a storage's history]: which earlier writes a replay may skip."""

    def __init__(self):
        super().__init__()
        self.twice = nn.Linear(12, 10)  # kaiming_uniform_, then normal_ over the whole weight
        nn.init.normal_(self.twice.weight, std=0.02)
        self.part_after = nn.Parameter(torch.empty(6, 4))
        nn.init.normal_(self.part_after)
        nn.init.uniform_(self.part_after[:2])  # a view: the first draw still shows in rows 2-5
        self.part_before = nn.Parameter(torch.empty(6, 4))
        nn.init.uniform_(self.part_before[3:])
        nn.init.normal_(self.part_before)  # whole, after a partial write: only this shows
        self.self_read = nn.Parameter(torch.empty(32).uniform_())
        self.self_read.data.bernoulli_(self.self_read.data)  # overwrites what it reads
        src = torch.randn(5, 3)
        self.copied = nn.Parameter(torch.empty(5, 3).uniform_())
        with torch.no_grad():
            self.copied.copy_(src * 2)  # whole, from another recorded tensor
        self.scaled = nn.Parameter(torch.empty(7).normal_())
        with torch.no_grad():
            self.scaled.mul_(0.5)  # reads what it writes: the normal_ stays


def test_whole_overwrites_skip_earlier_draws_and_keep_eager_values():
    """Values bitwise equal to eager construction, and the replay draws only what shows: per
    parameter, the elements of the random ops after its last whole overwrite (and of the
    tensors it was computed from), counted with torch's own random-op tag."""
    eager, lazy, after_eager, after_lazy = _build_both(Overwrites)
    assert torch.equal(after_eager, after_lazy)
    recording = recording_of(lazy)
    shown = {"twice.weight": 120, "twice.bias": 10, "part_after": 24 + 8, "part_before": 24,
             "self_read": 32 + 32, "copied": 15, "scaled": 7}
    for name, ref in _tensors(eager).items():
        draws = CountDraws()
        with draws:
            got = recording.value(_tensors(lazy)[name])
        assert torch.equal(got, ref.detach()), name
        assert draws.numel == shown[name], name
    assert recording.random_numel == 120 * 2 + 10 + 24 + 8 + 12 + 24 + 64 + 15 + 15 + 7
