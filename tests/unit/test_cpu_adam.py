"""CPU Adam against independent references: torch.optim.AdamW/Adam, a float64 formula, torch casts.

Backends: "native" (AVX-512 where the CPU has it), "scalar" (the kernel's portable loop) and "torch"
(the pure-torch fallback) are all exercised; the kernel is built once per machine and cached, so
only the first run on a machine pays the ~2 s per variant compile.
"""

from __future__ import annotations

import ctypes
import io
import math

import pytest
import torch

from infinity import _common
from infinity.optim import _cpu_adam_ext, cpu_adam
from infinity.optim.cpu_adam import CPUAdam, adam_step_flat

BACKENDS = ["native", "scalar", "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv(cpu_adam.BACKEND_ENV, request.param)
    return request.param


def reference_adam(p, grads, *, lr, beta1, beta2, eps, wd, adamw, bias_correction, grad_scale=1.0):
    """Textbook Adam/AdamW in float64 (Kingma & Ba; Loshchilov & Hutter), one step per grad."""
    p = p.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double() * grad_scale
        if adamw:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        mhat = m / (1 - beta1 ** t) if bias_correction else m
        vhat = v / (1 - beta2 ** t) if bias_correction else v
        p = p - lr * mhat / (vhat.sqrt() + eps)
    return p, m, v


def run_flat(p0, grads, *, state_dtype=torch.float32, out_dtype=None, grad_scale=1.0, num_threads=None, **hp):
    p = p0.clone()
    m, v = torch.zeros_like(p, dtype=state_dtype), torch.zeros_like(p, dtype=state_dtype)
    out = None if out_dtype is None else torch.empty_like(p, dtype=out_dtype)
    for t, g in enumerate(grads, start=1):
        adam_step_flat(p, g, m, v, step=t, out=out, grad_scale=grad_scale, num_threads=num_threads, **hp)
    return p, m, v, out


def flat_hp(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw_mode=True, bias_correction=True):
    return dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode,
                bias_correction=bias_correction)


def torch_run(p0, grads, *, adamw, **kw):
    p = torch.nn.Parameter(p0.clone())
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([p], foreach=False, **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("n,steps", [(1, 2000), (7, 2000), (1023, 2000), (2**20 + 3, 3)])
@pytest.mark.parametrize("adamw,wd", [(True, 0.0), (True, 0.1), (False, 0.1)])
def test_parity_with_torch_and_float64(backend, n, steps, adamw, wd):
    if backend != "native" and n > 2**20 and steps > 3:
        pytest.skip("large sizes are covered by the native backend")
    gen = torch.Generator().manual_seed(n + steps)
    p0 = torch.randn(n, generator=gen)
    # a per-element drift plus noise: the moments settle, so errors would accumulate, not cancel
    drift = torch.randn(n, generator=gen) * 0.1
    grads = [drift + torch.randn(n, generator=gen) for _ in range(steps)]
    lr = 1e-3
    ours, _, _, _ = run_flat(p0, grads, **flat_hp(lr=lr, weight_decay=wd, adamw_mode=adamw))
    theirs = torch_run(p0, grads, adamw=adamw, lr=lr, weight_decay=wd)
    ref, _, _ = reference_adam(p0, grads, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, wd=wd, adamw=adamw,
                               bias_correction=True)
    # fp32 round-off of the same math: ours is as close to float64 as torch's own fp32 AdamW is
    assert max_err(ours, ref) <= 2.0 * max_err(theirs, ref) + 1e-6
    assert max_err(ours, theirs) <= 2e-6 * math.sqrt(steps) + 1e-6


@pytest.mark.parametrize("bias_correction", [True, False])
def test_bias_correction_and_grad_scale_against_float64(backend, bias_correction):
    n, steps, scale = 1023, 1500, 0.37  # e.g. 1/loss_scale times a clip coefficient
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) + 0.2 for _ in range(steps)]
    hp = flat_hp(lr=1e-3, weight_decay=0.05, bias_correction=bias_correction, eps=1e-6)
    ours, m, v, _ = run_flat(p0, grads, grad_scale=scale, **hp)
    ref, m_ref, v_ref = reference_adam(p0, grads, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, wd=0.05,
                                       adamw=True, bias_correction=bias_correction, grad_scale=scale)
    # bound: a few fp32 roundings (2^-23 relative) per step, accumulated linearly over the run
    fp32_bound = steps * 2.0 ** -21 * ref.abs().max().item()
    assert max_err(ours, ref) < fp32_bound
    if bias_correction:  # the same run in torch's fp32 AdamW, on grads scaled up front
        theirs = torch_run(p0, [g * scale for g in grads], adamw=True, lr=1e-3, weight_decay=0.05, eps=1e-6)
        assert max_err(ours, ref) <= 2.0 * max_err(theirs, ref) + 1e-6
    assert max_err(m, m_ref) < 1e-5  # the moments are EMAs: their rounding errors do not accumulate
    assert max_err(v, v_ref) < 1e-5


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_grads(backend, grad_dtype):
    n = 1027
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(50)]
    ours, _, _, _ = run_flat(p0, grads, **flat_hp(weight_decay=0.1, adamw_mode=False))
    ref = torch_run(p0, [g.float() for g in grads], adamw=False, lr=1e-2, weight_decay=0.1)
    assert max_err(ours, ref) < 1e-5


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 1023, 2**20 + 3])
def test_copy_out_equals_torch_cast(backend, out_dtype, n):
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen) * 3
    grads = [torch.randn(n, generator=gen) for _ in range(2)]
    p, _, _, out = run_flat(p0, grads, out_dtype=out_dtype, **flat_hp())
    assert out.dtype == out_dtype
    assert torch.equal(out, p.to(out_dtype))  # round-to-nearest-even, exactly as torch casts


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
def test_every_dtype_combination(backend, state_dtype, out_dtype):
    # A 16-bit gradient must act exactly like its (exact) fp32 cast; the copy-out must equal the
    # torch cast of the master, whatever the moments' dtype.
    n = 1027
    gen = torch.Generator().manual_seed(21)
    p0 = torch.randn(n, generator=gen)
    for grad_dtype in (torch.bfloat16, torch.float16):
        grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(3)]
        low = run_flat(p0, grads, state_dtype=state_dtype, out_dtype=out_dtype, grad_scale=0.5,
                       **flat_hp(weight_decay=0.1, adamw_mode=False))
        ref = run_flat(p0, [g.float() for g in grads], state_dtype=state_dtype, grad_scale=0.5,
                       **flat_hp(weight_decay=0.1, adamw_mode=False))
        for a, b in zip(low[:3], ref[:3]):
            assert a.dtype == b.dtype and torch.equal(a, b)
        if out_dtype is not None:
            assert torch.equal(low[3], low[0].to(out_dtype))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_large_copy_out_uses_the_streaming_path_correctly(out_dtype):
    # above 16 MiB of output the kernel writes `out` with non-temporal stores; an odd size leaves a tail
    n = (1 << 23) + 5
    gen = torch.Generator().manual_seed(31)
    p = torch.randn(n, generator=gen)
    m, v, g = torch.zeros(n), torch.zeros(n), torch.randn(n, generator=gen)
    out = torch.empty(n + 16, dtype=out_dtype)[16:]  # 32-byte aligned view into a larger buffer
    adam_step_flat(p, g, m, v, step=1, out=out, **flat_hp())
    assert torch.equal(out, p.to(out_dtype))


def test_results_do_not_depend_on_thread_count():
    n = (1 << 17) + 5  # large enough to be split across threads
    gen = torch.Generator().manual_seed(11)
    p0 = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in range(3)]
    for state_dtype in (torch.float32, torch.bfloat16):
        one = run_flat(p0, grads, state_dtype=state_dtype, num_threads=1, **flat_hp())
        two = run_flat(p0, grads, state_dtype=state_dtype, num_threads=2, **flat_hp())
        for a, b in zip(one[:3], two[:3]):
            assert torch.equal(a, b)


def test_empty_tensors_are_a_no_op():
    """Zero elements: nothing is read or written, also through empty views of real buffers."""
    e = torch.empty(0)
    assert adam_step_flat(e, e, e, e, step=1, **flat_hp()) is None
    assert e.numel() == 0
    p, g, m, v = (torch.full((8,), x) for x in (1.0, 2.0, 3.0, 4.0))
    out = torch.full((8,), 5.0, dtype=torch.bfloat16)
    adam_step_flat(p[3:3], g[3:3], m[3:3], v[3:3], step=1, out=out[3:3], **flat_hp())
    for t, x in ((p, 1.0), (g, 2.0), (m, 3.0), (v, 4.0), (out, 5.0)):
        assert torch.equal(t, torch.full((8,), x, dtype=t.dtype))


# ------------------------------------------------------------------------------------------ bf16 states
def drifting_grads(n: int, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Initial parameters and ``steps`` noisy gradients with a per-element drift (seeded)."""
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen)
    drift = torch.randn(n, generator=gen) * 0.3
    return p0, [drift + torch.randn(n, generator=gen) for _ in range(steps)]


def test_bf16_states_track_fp32_over_thousands_of_steps(backend):
    n, steps = 512, 3000
    p0, grads = drifting_grads(n, steps)
    hp = flat_hp(lr=1e-3, weight_decay=0.01)
    p32, m32, v32, _ = run_flat(p0, grads, **hp)
    p16, m16, v16, _ = run_flat(p0, grads, state_dtype=torch.bfloat16, **hp)
    moved = (p32 - p0).abs().mean().item()
    assert moved > 0.5  # the run went somewhere, so a relative bound means something
    dp = (p16 - p32).abs().mean().item()
    assert dp < 0.015 * moved
    assert max_err(p16, p32) < 0.05 * (p32 - p0).abs().max().item()
    # exp_avg_sq: each stochastic store adds zero-mean noise of up to one bf16 ulp (2^-8 relative);
    # the EMA keeps ~1/sqrt(2 * (1 - beta2)) ~ 22 steps' worth of it, so a few % per element, but
    # no bias: the mean over elements of the signed relative error stays near zero
    rel_v = (v16.double() - v32.double()) / v32.double()
    assert rel_v.abs().mean().item() < 0.06
    assert abs(rel_v.mean().item()) < 0.005
    m_scale = m32.double().abs().mean()
    assert ((m16.double() - m32.double()).abs().mean() / m_scale).item() < 0.02

    # the same run with round-to-nearest bf16 storage: exp_avg_sq stalls (its ~0.1 % steps are
    # below half an ulp), a large one-sided error, and the parameters drift further
    p, m, v = p0.clone(), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    for t, g in enumerate(grads, start=1):
        mf, vf = m.float(), v.float()
        adam_step_flat(p, g, mf, vf, step=t, **hp)
        m, v = mf.to(torch.bfloat16), vf.to(torch.bfloat16)
    rel_v_nearest = (v.double() - v32.double()) / v32.double()
    assert abs(rel_v_nearest.mean().item()) > 20 * max(abs(rel_v.mean().item()), 0.005)
    assert (p - p32).abs().mean().item() > 3 * dp


def test_bf16_states_are_unbiased():
    # One step from zero state: exp_avg = 0.1 * g exactly in fp32; the bf16 store must average to it.
    n = 1 << 16
    g = torch.full((n,), 1.0 / 3.0)  # 0.1*g = 0.0333...: not a bf16 value
    p, m, v = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    adam_step_flat(p, g, m, v, step=1, **flat_hp())
    exact = (torch.tensor(0.1, dtype=torch.float32) * g[0]).item()
    assert len(torch.unique(m)) == 2  # both neighbours occur
    assert abs(m.double().mean().item() - exact) < 1e-3 * exact


# ------------------------------------------------------------------------------------------ optimizer
def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).to(dtype)


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    threads = torch.get_num_threads()
    # tiny matmuls: intra-op threads only add fork/join waits (seconds when the cores are shared)
    torch.set_num_threads(1)
    try:
        _train_steps(model, opt, steps, gen)
    finally:
        torch.set_num_threads(threads)


def _train_steps(model, opt, steps, gen):
    for _ in range(steps):
        x = torch.randn(32, 8, generator=gen)
        y = torch.randn(32, 3, generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        loss.backward()
        opt.step()


def _groups(model, **extra):
    return [{"params": [model[0].weight, model[0].bias], "lr": 3e-3, "weight_decay": 0.1, **extra},
            {"params": [model[2].weight, model[2].bias], "betas": (0.8, 0.99), "eps": 1e-6}]


@pytest.mark.parametrize("adamw", [True, False])
def test_optimizer_param_groups_match_torch(backend, adamw):
    ours_m, theirs_m = _model(), _model()
    ours = CPUAdam(_groups(ours_m), lr=1e-3, weight_decay=0.01, adamw_mode=adamw)
    theirs = (torch.optim.AdamW if adamw else torch.optim.Adam)(_groups(theirs_m), lr=1e-3, weight_decay=0.01)
    _train(ours_m, ours, 100)
    _train(theirs_m, theirs, 100)
    for a, b in zip(ours_m.parameters(), theirs_m.parameters()):
        assert max_err(a, b) < 1e-4
    assert ours.param_groups[0]["lr"] == 3e-3 and ours.param_groups[1]["betas"] == (0.8, 0.99)


def test_optimizer_any_shape_and_strided_params():
    shapes = [(), (1,), (3, 5), (2, 3, 4)]
    gen = torch.Generator().manual_seed(2)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    base = torch.randn(6, 4, generator=gen)
    ours.append(torch.nn.Parameter(base.clone().t()))  # non-contiguous parameter
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    theirs[-1] = torch.nn.Parameter(base.clone().t())
    o1, o2 = CPUAdam(ours, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1)
    for _ in range(20):
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        o1.step(), o2.step()
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and max_err(a, b) < 1e-5
    o1.zero_grad()
    assert all(p.grad is None for p in ours)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_fp32_master(dtype):
    ours_m, ref_m = _model(dtype=dtype), _model(dtype=torch.float32)
    ours = CPUAdam(ours_m.parameters(), lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-3, weight_decay=0.01)
    with torch.no_grad():  # same start: the reference starts from the rounded values
        for a, b in zip(ours_m.parameters(), ref_m.parameters()):
            b.copy_(a.float())
    gen = torch.Generator().manual_seed(4)
    for _ in range(30):
        for a, b in zip(ours_m.parameters(), ref_m.parameters()):
            g = torch.randn(a.shape, generator=gen) * 1e-2
            a.grad, b.grad = g.to(dtype), g.to(dtype).float()
        ours.step(), ref.step()
    for a, b in zip(ours_m.parameters(), ref_m.parameters()):
        master = ours.state[a]["master_param"]
        assert master.dtype == torch.float32 and max_err(master, b) < 1e-5
        assert a.dtype == dtype and torch.equal(a.detach(), master.to(dtype))


def test_tensor_lr_follows_in_place_changes():
    ours_m, theirs_m = _model(), _model()
    lr1, lr2 = torch.tensor(1e-2), torch.tensor(1e-2)
    ours = CPUAdam(ours_m.parameters(), lr=lr1, weight_decay=0.01)
    theirs = torch.optim.AdamW(theirs_m.parameters(), lr=lr2, weight_decay=0.01, foreach=False)
    _train(ours_m, ours, 10), _train(theirs_m, theirs, 10)
    lr1.mul_(0.1), lr2.mul_(0.1)  # a scheduler that updates the tensor in place
    _train(ours_m, ours, 10, seed=2), _train(theirs_m, theirs, 10, seed=2)
    for a, b in zip(ours_m.parameters(), theirs_m.parameters()):
        assert max_err(a, b) < 1e-5


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("adamw", [True, False])
def test_state_dict_from_torch_into_cpu_adam(adamw):
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    a, b = _model(), _model()
    ta = torch_cls(_groups(a), lr=1e-3, weight_decay=0.01)
    _train(a, ta, 20)
    b.load_state_dict(a.state_dict())
    ours = CPUAdam(_groups(b), lr=5.0, adamw_mode=not adamw)  # wrong on purpose: the state dict wins
    ours.load_state_dict(_roundtrip(ta.state_dict()))
    assert ours.param_groups[0]["adamw_mode"] == adamw and ours.param_groups[0]["lr"] == 3e-3
    _train(a, ta, 20, seed=9), _train(b, ours, 20, seed=9)
    for x, y in zip(a.parameters(), b.parameters()):
        assert max_err(x, y) < 1e-5


@pytest.mark.parametrize("adamw", [True, False])
def test_state_dict_from_cpu_adam_into_torch(adamw):
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    a, b = _model(), _model()
    ours = CPUAdam(_groups(a), lr=1e-3, weight_decay=0.01, adamw_mode=adamw)
    _train(a, ours, 20)
    b.load_state_dict(a.state_dict())
    ta = torch_cls(_groups(b), lr=1e-3)
    ta.load_state_dict(_roundtrip(ours.state_dict()))
    _train(a, ours, 20, seed=9), _train(b, ta, 20, seed=9)
    for x, y in zip(a.parameters(), b.parameters()):
        assert max_err(x, y) < 1e-5


def test_state_dict_keeps_master_and_bf16_moments():
    a, b = _model(dtype=torch.bfloat16), _model(dtype=torch.bfloat16)
    oa = CPUAdam(a.parameters(), lr=1e-3, state_dtype=torch.bfloat16)
    _train(a, oa, 5)
    b.load_state_dict(a.state_dict())
    ob = CPUAdam(b.parameters(), lr=1e-3, state_dtype=torch.bfloat16)
    ob.load_state_dict(_roundtrip(oa.state_dict()))
    for pa, pb in zip(a.parameters(), b.parameters()):
        sa, sb = oa.state[pa], ob.state[pb]
        assert sb["master_param"].dtype == torch.float32 and torch.equal(sa["master_param"], sb["master_param"])
        assert sb["exp_avg_sq"].dtype == torch.bfloat16 and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    _train(a, oa, 5, seed=3), _train(b, ob, 5, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


# ------------------------------------------------------------------------------------------ errors
def _flat(n=16, dtype=torch.float32):
    return torch.zeros(n, dtype=dtype)


@pytest.mark.parametrize("case,match", [
    ("size", r"`exp_avg` has 15 elements but `param` has 16"),
    ("strided", r"`grad` must be contiguous"),
    ("meta", r"`exp_avg_sq` must be a CPU tensor, got device meta"),
    ("param_dtype", r"`param` has dtype bfloat16; expected one of float32"),
    ("grad_dtype", r"`grad` has dtype int32"),
    ("state_dtype", r"`exp_avg` has dtype float16"),
    ("mixed_states", r"both moments must have the same dtype"),
    ("out_dtype", r"`out` has dtype float32; expected one of bfloat16, float16"),
    ("out_size", r"`out` has 8 elements but `param` has 16"),
    ("step", r"`step` must be an integer >= 1"),
    ("beta", r"invalid `beta2` 1.0"),
])
def test_bad_inputs_name_the_argument(case, match):
    args = dict(param=_flat(), grad=_flat(), exp_avg=_flat(), exp_avg_sq=_flat())
    kw = dict(step=1, **flat_hp())
    if case == "size":
        args["exp_avg"] = _flat(15)
    elif case == "strided":
        args["grad"] = torch.zeros(32)[::2]
    elif case == "meta":
        args["exp_avg_sq"] = torch.zeros(16, device="meta")
    elif case == "param_dtype":
        args["param"] = _flat(dtype=torch.bfloat16)
    elif case == "grad_dtype":
        args["grad"] = _flat(dtype=torch.int32)
    elif case == "state_dtype":
        args["exp_avg"] = _flat(dtype=torch.float16)
    elif case == "mixed_states":
        args["exp_avg"] = _flat(dtype=torch.bfloat16)
    elif case == "out_dtype":
        kw["out"] = _flat()
    elif case == "out_size":
        kw["out"] = _flat(8, dtype=torch.bfloat16)
    elif case == "step":
        kw["step"] = 0
    elif case == "beta":
        kw["beta2"] = 1.0
    with pytest.raises(ValueError, match=match):
        adam_step_flat(**args, **kw)


@pytest.mark.parametrize("option", [dict(amsgrad=True), dict(maximize=True), dict(capturable=True),
                                    dict(differentiable=True), dict(fused=True), dict(foreach=True),
                                    dict(momentum=0.9)])
def test_unsupported_options_raise(option):
    with pytest.raises(ValueError, match=next(iter(option))):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], **option)


def test_unsupported_options_in_groups_and_state_dicts_raise():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([{"params": [p], "amsgrad": True}])
    ams = torch.optim.AdamW([p], amsgrad=True)
    p.grad = torch.ones(2)
    ams.step()
    with pytest.raises(ValueError, match="amsgrad=True"):
        CPUAdam([p]).load_state_dict(ams.state_dict())
    CPUAdam([p], amsgrad=False, maximize=False, foreach=None)  # "off" is what CPUAdam does: accepted


def test_optimizer_rejects_bad_params():
    with pytest.raises(ValueError, match="device meta"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2, device="meta"))])
    with pytest.raises(ValueError, match="float64"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    with pytest.raises(ValueError, match="invalid `lr`"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], lr=-1.0)


# ------------------------------------------------------------------------------------------ misc
def test_fallback_without_compiler_warns_once_and_is_correct(monkeypatch):
    monkeypatch.setenv(cpu_adam.BACKEND_ENV, "auto")
    monkeypatch.setattr(_cpu_adam_ext, "load", lambda *a, **k: None)
    _common.reset_warnings_for_tests()
    gen = torch.Generator().manual_seed(8)
    p0 = torch.randn(100, generator=gen)
    grads = [torch.randn(100, generator=gen) for _ in range(5)]
    with pytest.warns(UserWarning, match="pure-torch path"):
        ours, _, _, _ = run_flat(p0, grads, **flat_hp())
    assert cpu_adam.backend() == "torch"
    assert max_err(ours, torch_run(p0, grads, adamw=True, lr=1e-2, weight_decay=0.0)) < 1e-6


def test_kernel_releases_the_gil():
    # ctypes.CDLL (unlike PyDLL) drops the GIL for the duration of every foreign call
    lib = _cpu_adam_ext.load("native", raise_on_error=True)
    assert isinstance(lib, ctypes.CDLL) and not isinstance(lib, ctypes.PyDLL)


def test_zeros_host_large_buffers_are_zeroed_writable_and_staggered(monkeypatch):
    from infinity.io import _huge_pages
    monkeypatch.setattr(_huge_pages, "_decision", True)  # the huge-page layout is what staggers
    n = (4 << 20) // 4 + 7  # just above the huge-page threshold
    a, b = cpu_adam.zeros_host(n, torch.float32), cpu_adam.zeros_host(n, torch.bfloat16)
    assert a.shape == (n,) and a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert not a.any() and not b.any()
    a.fill_(1.5)
    assert a.sum().item() == 1.5 * n
    ptrs = {cpu_adam.zeros_host(n, torch.float32).data_ptr() % 4096 for _ in range(3)} | {a.data_ptr() % 4096}
    assert len(ptrs) > 1  # not all on the same offset within a page


def test_optimizer_large_parameter_with_host_state_matches_torch():
    gen = torch.Generator().manual_seed(12)
    p0 = torch.randn(2**20 + 3, generator=gen)
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    oa, ob = CPUAdam([a], lr=1e-2, weight_decay=0.1), torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(p0.shape, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step(), ob.step()
    assert max_err(a, b) < 1e-5
    ob2 = torch.optim.AdamW([torch.nn.Parameter(p0.clone())])
    ob2.load_state_dict(oa.state_dict())  # mmap-backed state tensors serialize like any other
    assert torch.equal(ob2.state[ob2.param_groups[0]["params"][0]]["exp_avg"], oa.state[a]["exp_avg"])


# ------------------------------------------------------------------------------------------ device path
def test_the_device_step_rounds_bf16_moments_as_the_cpu_kernel_does():
    """``adam_step_flat_reference`` is the step a GPU runs (``adam_kernel_for``); here on CPU
    tensors. With bf16 moments it must not round to nearest (exp_avg_sq would stall at
    beta2 = 0.999): its run tracks fp32 like the CPU kernel's, unbiased."""
    from infinity.optim import adam_step_flat_reference

    n, steps = 512, 1500
    p0, grads = drifting_grads(n, steps)
    hp = flat_hp(lr=1e-3, weight_decay=0.01)
    p32, m32, v32, _ = run_flat(p0, grads, **hp)
    p, m = p0.clone(), torch.zeros(n, dtype=torch.bfloat16)
    v = torch.zeros(n, dtype=torch.bfloat16)
    out = torch.empty(n, dtype=torch.bfloat16)
    for t, g in enumerate(grads, start=1):
        adam_step_flat_reference(p, g, m, v, step=t, out=out, **hp)
    assert m.dtype == v.dtype == torch.bfloat16 and torch.equal(out, p.to(torch.bfloat16))
    rel_v = (v.double() - v32.double()) / v32.double()
    assert abs(rel_v.mean().item()) < 0.005  # round-to-nearest: a one-sided stall, > 0.1
    assert rel_v.abs().mean().item() < 0.06
    moved = (p32 - p0).abs().mean().item()
    assert (p - p32).abs().mean().item() < 0.015 * moved
    # One step from zero moments: both bf16 neighbours of 0.1 * g occur, averaging to it.
    k = 1 << 16
    g = torch.full((k,), 1.0 / 3.0)
    m1, v1 = torch.zeros(k, dtype=torch.bfloat16), torch.zeros(k, dtype=torch.bfloat16)
    adam_step_flat_reference(torch.zeros(k), g, m1, v1, step=1, **flat_hp())
    exact = (torch.tensor(0.1, dtype=torch.float32) * g[0]).item()
    assert len(torch.unique(m1)) == 2
    assert abs(m1.double().mean().item() - exact) < 1e-3 * exact


def test_the_memory_probe_moves_the_steps_bytes(monkeypatch):
    """[memory probe] (``infinity bench adam``'s limit for the fp32 step): it reads the four fp32
    streams and writes three, each the input plus the gradient; without the compiled kernel it
    says so (False) and touches nothing."""
    n = 1000 + 13  # not a multiple of any vector width
    gen = torch.Generator().manual_seed(3)
    p, g, m, v = (torch.randn(n, generator=gen) for _ in range(4))
    want = (p + g, g.clone(), m + g, v + g)
    if cpu_adam.backend() == "torch":
        pytest.skip("no compiled kernel here")
    assert cpu_adam.memory_probe(p, g, m, v, num_threads=2) is True
    for got, expected in zip((p, g, m, v), want):
        assert torch.equal(got, expected)
    monkeypatch.setenv(cpu_adam.BACKEND_ENV, "torch")
    before = p.clone()
    assert cpu_adam.memory_probe(p, g, m, v) is False and torch.equal(p, before)
    with pytest.raises(ValueError, match="exp_avg"):
        monkeypatch.setenv(cpu_adam.BACKEND_ENV, "auto")
        cpu_adam.memory_probe(p, g, m[:5], v)
