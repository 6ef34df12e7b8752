"""The rollout's weight-matmul kernels: oneDNN-packed weights give F.linear's products in IEEE float32,
the same completions as the modules as they are, and leave the modules untouched after the rollout."""

import pytest
import torch
from torch import nn

from tests.rollout.conftest import build_model, random_prompts
from turbogrpo import linears
from turbogrpo.cpu_capability import cpu_capability
from turbogrpo.rollout import SamplingConfig, generate
from turbogrpo.rollout.decode import DecodeSchedule
from turbogrpo.linears import LINEAR_KERNELS, TRAINING_LINEAR_KERNELS, OneDnnLinear, onednn_available, onednn_is_faster, onednn_linears, \
    onednn_product, pack_weight

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")

ONEDNN = DecodeSchedule(linears="onednn")
MODULES = DecodeSchedule(linears="module")


@pytest.mark.parametrize("rows", [(1,), (3,), (33,), (2, 5)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_packed_product_is_f_linear_within_float32_rounding(rows, with_bias):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 40, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(*rows, 40, generator=generator)
    truth = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    ours = onednn_product(x, pack_weight(weight), bias)
    assert ours.shape == (*rows, 96) and ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), truth, atol=2e-5, rtol=1e-5)


def test_the_packed_product_is_ieee_float32_not_a_bf16_or_tf32_shortcut():
    # 1 + 2^-9 + 2^-18 + 2^-23 needs all 24 bits of a float32 significand: bf16x3 or TF32 products drop
    # the low bits (an error of 2^-18 or more), IEEE float32 keeps the product by 1.0 exact.
    value = 1 + 2 ** -9 + 2 ** -18 + 2 ** -23
    x = torch.zeros(32, 64)
    x[:, 0] = value
    weight = torch.zeros(128, 64)
    weight[:, 0] = 1.0
    assert (onednn_product(x, pack_weight(weight))[:, 0] == value).all()


def assert_packed_rollout_matches_modules(monkeypatch, model, lengths, sampling, tolerance: float) -> None:
    """The same completions (and sampler log-probs within ``tolerance``) on packed weights as on the
    modules, with every weight matmul of the packed rollout run by oneDNN: one product per forward for each
    layer's q/k/v and one for its gate/up, one for each other linear."""
    kwargs = dict(num_samples=4, sampling=sampling, seed=7)
    calls = []
    monkeypatch.setattr(linears, "onednn_product", lambda *args: calls.append(1) or onednn_product(*args))
    ours = generate(model, random_prompts(lengths), schedule=ONEDNN, **kwargs)
    products_per_forward = sum(isinstance(m, nn.Linear) for m in model.modules()) - 3 * model.config.num_hidden_layers
    assert len(calls) % products_per_forward == 0 and calls
    monkeypatch.undo()
    reference = generate(model, random_prompts(lengths), schedule=MODULES, **kwargs)
    assert [t.tolist() for t in ours.tokens] == [t.tolist() for t in reference.tokens]
    for a, b in zip(ours.logprobs, reference.logprobs):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=tolerance)


def test_a_rollout_on_packed_weights_gives_the_modules_completions(monkeypatch):
    assert_packed_rollout_matches_modules(monkeypatch, build_model("llama", seed=3), [5, 9],
                                          SamplingConfig(max_new_tokens=12, stop_token_ids=(0, 1, 2)), 1e-5)


@pytest.mark.skipif(not cpu_capability().packs(torch.bfloat16),
                    reason="this CPU has no oneDNN bf16 kernels (tests/test_cpu_capability.py checks the refusal)")
def test_under_bf16_autocast_the_packed_weights_are_what_autocast_computes_with(monkeypatch):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_packed_rollout_matches_modules(monkeypatch, build_model("llama", seed=6), [7, 4],
                                              SamplingConfig(max_new_tokens=10, stop_token_ids=(0, 1)), 2e-2)


def test_the_modules_are_restored_and_the_next_rollout_sees_the_optimizer_step():
    model = build_model("qwen2", seed=4)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    kwargs = dict(num_samples=2, sampling=SamplingConfig(max_new_tokens=6, temperature=0.0), seed=0)
    generate(model, random_prompts([6]), schedule=ONEDNN, **kwargs)
    assert not any("forward" in m.__dict__ for m in linears)
    # Training runs the modules as they are, with gradients.
    model.train()
    loss = model(input_ids=random_prompts([6])[0][None]).logits.square().mean()
    loss.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)  # an "optimizer step", in place
    model.eval()
    after = generate(model, random_prompts([6]), schedule=ONEDNN, **kwargs)
    reference = generate(model, random_prompts([6]), schedule=MODULES, **kwargs)
    assert [t.tolist() for t in after.tokens] == [t.tolist() for t in reference.tokens]


def test_modules_it_cannot_run_exactly_are_left_as_they_are():
    class Scaled(nn.Linear):
        def forward(self, input):
            return 2 * super().forward(input)

    hooked = nn.Linear(4, 4)
    hooked.forward = lambda input: input  # as accelerate's hooks do
    root = nn.Sequential(nn.Linear(4, 4), Scaled(4, 4), nn.Linear(4, 4).double(), hooked)
    with onednn_linears([root, root]) as num_packed:
        assert num_packed == 1
        assert "forward" in root[0].__dict__ and "forward" not in root[1].__dict__
        assert "forward" not in root[2].__dict__ and root[3].forward(torch.ones(4)).sum() == 4
    assert "forward" not in root[0].__dict__ and "forward" in root[3].__dict__


def test_a_failing_rollout_still_restores_the_modules():
    model = build_model("qwen2", seed=5)
    with pytest.raises(RuntimeError, match="boom"):
        with onednn_linears([model]):
            raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_the_schedule_names_a_registered_kernel_and_packs_only_eager_steps():
    assert set(LINEAR_KERNELS) == {"auto", "module", "onednn"}
    assert isinstance(onednn_is_faster(torch.float32, torch.get_num_threads()), bool)
    assert onednn_is_faster(torch.float64, 1) is False
    assert linears.onednn_min_rows(torch.float32, torch.get_num_threads()) in (None, *linears.ROW_GRID)
    assert linears.onednn_trains_faster(torch.float32, torch.get_num_threads()) in (None, 1)
    assert linears.onednn_trains_faster(torch.bfloat16, 1) is None  # bf16 training runs autocast's F.linear
    with pytest.raises(ValueError, match="linears must be one of"):
        DecodeSchedule(linears="mkl")
    with pytest.raises(ValueError, match="runner='eager' or 'compiled-onednn' only"):
        DecodeSchedule(linears="onednn", runner="dynamo")
    DecodeSchedule(linears="onednn", runner="compiled-onednn")  # its graphs call the packed products themselves


def test_the_onednn_training_linear_gives_f_linears_values_and_gradients():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(24, 16, generator=generator, requires_grad=True)
    bias = torch.randn(24, generator=generator, requires_grad=True)
    x = torch.randn(3, 5, 16, generator=generator, requires_grad=True)
    grad = torch.randn(3, 5, 24, generator=generator)
    ours = OneDnnLinear.apply(x, weight, bias)
    ours_grads = torch.autograd.grad(ours, (x, weight, bias), grad)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    truth = torch.nn.functional.linear(x64, w64, b64)
    truth_grads = torch.autograd.grad(truth, (x64, w64, b64), grad.double())
    torch.testing.assert_close(ours.double(), truth, atol=1e-5, rtol=1e-5)
    for a, b in zip(ours_grads, truth_grads):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5)


def test_a_model_trains_to_the_same_gradients_under_the_onednn_training_kernel():
    model = build_model("qwen2", seed=8).train()
    ids = random_prompts([9])[0][None]

    def gradients():
        model.zero_grad()
        model(input_ids=ids).logits.log_softmax(-1).mean().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    reference = gradients()
    with TRAINING_LINEAR_KERNELS["onednn"]([model]) as num_changed:
        assert num_changed == sum(isinstance(m, nn.Linear) for m in model.modules())
        ours = gradients()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast runs F.linear as is
            model(input_ids=ids)
    assert not any("forward" in m.__dict__ for m in model.modules())
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], atol=1e-5, rtol=1e-4, msg=name)


def test_below_the_row_threshold_the_modules_own_product_runs_and_nothing_is_packed(monkeypatch):
    model = build_model("llama", seed=2)
    num_linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    products, packs = [], []
    monkeypatch.setattr(linears, "onednn_product", lambda *args: products.append(args[0].shape) or onednn_product(*args))
    monkeypatch.setattr(linears, "pack_weight", lambda *args: packs.append(1) or pack_weight(*args))
    x = torch.randn(3, model.config.hidden_size)
    layer = model.model.layers[0].mlp.up_proj
    with onednn_linears([model], min_rows=4) as num_packed:
        assert num_packed == num_linears
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight))   # 3 rows: F.linear
        assert products == [] and packs == []
        wide = torch.randn(2, 2, model.config.hidden_size)                                   # 4 rows: oneDNN
        torch.testing.assert_close(layer(wide), torch.nn.functional.linear(wide, layer.weight), atol=1e-5, rtol=1e-5)
        layer(wide)
        assert products == [(2, 2, model.config.hidden_size)] * 2 and packs == [1]           # packed once, lazily
    # A rollout of 4 samples decodes 4 rows: every product by oneDNN from the first decoding step.
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.0)
    products.clear()
    with onednn_linears([model], min_rows=4):
        ours = generate(model, random_prompts([6]), num_samples=4, sampling=sampling, seed=0, schedule=MODULES)
    assert products and all(shape[0] * (shape[1] if len(shape) == 3 else 1) >= 4 for shape in products)
    reference = generate(model, random_prompts([6]), num_samples=4, sampling=sampling, seed=0, schedule=MODULES)
    assert [t.tolist() for t in ours.tokens] == [t.tolist() for t in reference.tokens]


def test_the_training_kernel_leaves_few_row_products_to_f_linear(monkeypatch):
    layer = nn.Linear(8, 6)
    calls = []
    monkeypatch.setattr(linears, "onednn_product", lambda *args: calls.append(1) or onednn_product(*args))
    with TRAINING_LINEAR_KERNELS["onednn"]([layer]):
        layer(torch.randn(2, 8)).sum().backward()
    assert calls  # min_rows 1: every product
    calls.clear()
    with linears.onednn_training_linears([layer], min_rows=3):
        layer(torch.randn(2, 8)).sum().backward()
        assert not calls
        layer(torch.randn(3, 8, requires_grad=True)).sum().backward()
        assert len(calls) == 3  # the forward and both backward products


def sibling_root(bias: bool = True) -> nn.Module:
    root = nn.Module()
    generator = torch.Generator().manual_seed(3)
    for name, width in (("q_proj", 12), ("k_proj", 4), ("v_proj", 4), ("o_proj", 8)):
        setattr(root, name, nn.Linear(8, width, bias=bias))
        with torch.no_grad():
            for p in getattr(root, name).parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
    return root


@pytest.mark.parametrize("bias", [False, True])
def test_sibling_linears_share_one_packed_product_and_each_gets_its_own_output(monkeypatch, bias):
    root = sibling_root(bias)
    x = torch.randn(5, 8)
    truth = {name: getattr(root, name)(x) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    products, packs = [], []
    monkeypatch.setattr(linears, "onednn_product", lambda *args: products.append(args[1].shape) or onednn_product(*args))
    monkeypatch.setattr(linears, "pack_weight", lambda *args: packs.append(args[0].shape) or pack_weight(*args))
    with torch.no_grad(), onednn_linears([root]) as num_packed:
        assert num_packed == 4
        ours = {name: getattr(root, name)(x) for name in ("v_proj", "q_proj", "k_proj", "o_proj")}  # any order
        assert len(products) == 2 and sorted(packs) == [(8, 8), (20, 8)]  # q/k/v stacked, o_proj alone
        for name, value in truth.items():
            torch.testing.assert_close(ours[name], value, atol=1e-5, rtol=1e-5, msg=name)
        # Every slice taken: a new call computes afresh, as does a call on another tensor or the same
        # tensor changed in place.
        root.k_proj(x)
        y = torch.randn(5, 8)
        torch.testing.assert_close(root.q_proj(y), nn.functional.linear(y, root.q_proj.weight, root.q_proj.bias),
                                   atol=1e-5, rtol=1e-5)
        y.mul_(2)
        torch.testing.assert_close(root.k_proj(y), nn.functional.linear(y, root.k_proj.weight, root.k_proj.bias),
                                   atol=1e-5, rtol=1e-5)
        assert len(products) == 5
    assert not any("forward" in m.__dict__ for m in root.modules())


def test_siblings_that_differ_in_shape_bias_or_kind_are_packed_one_by_one(monkeypatch):
    packs = []
    monkeypatch.setattr(linears, "pack_weight", lambda *args: packs.append(args[0].shape) or pack_weight(*args))
    mixed_bias = sibling_root()
    mixed_bias.k_proj = nn.Linear(8, 4, bias=False)
    other_width = nn.Module()
    other_width.gate_proj, other_width.up_proj = nn.Linear(8, 6), nn.Linear(7, 6)
    double = nn.Module()
    double.gate_proj, double.up_proj = nn.Linear(8, 6).double(), nn.Linear(8, 6)
    with torch.no_grad(), onednn_linears([mixed_bias, other_width, double]) as num_packed:
        assert num_packed == 7  # all but the float64 one
        for root, width in ((mixed_bias, 8), (other_width, 8), (double, 8)):
            for name in ("q_proj", "k_proj", "v_proj", "gate_proj"):
                if hasattr(root, name):
                    getattr(root, name)(torch.randn(3, width).to(getattr(root, name).weight.dtype))
        other_width.up_proj(torch.randn(3, 7))
    assert sorted(packs) == sorted([(12, 8), (4, 8), (4, 8), (6, 8), (6, 7)])


GRAD_MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}


@pytest.mark.parametrize("kernel", ["module", "onednn", "auto"])
def test_generate_gives_the_same_rollout_under_inference_mode_no_grad_and_grad(kernel):
    # 8 layers of q/k/v and gate/up siblings: the packed kernel's shared products run at every layer.
    model = build_model("qwen2", seed=8, num_hidden_layers=8)
    kwargs = dict(num_samples=3, sampling=SamplingConfig(max_new_tokens=8, stop_token_ids=(0,)), seed=2,
                  schedule=DecodeSchedule(linears=kernel))
    rollouts = {}
    for name, mode in GRAD_MODES.items():
        with mode():
            rollouts[name] = generate(model, random_prompts([9, 4]), **kwargs)
    reference = rollouts.pop("no_grad")
    for name, rollout in rollouts.items():
        assert [t.tolist() for t in rollout.tokens] == [t.tolist() for t in reference.tokens], name
        assert all(torch.equal(a, b) for a, b in zip(rollout.logprobs, reference.logprobs)), name
        assert not any(t.is_inference() or t.requires_grad for t in rollout.logprobs), name
    # a caller may train on what a rollout under inference_mode returned
    logprob = rollouts["inference_mode"].logprobs[0].clone().requires_grad_()
    logprob.sum().backward()


def test_siblings_given_an_inference_tensor_each_compute_exactly():
    root = sibling_root()
    with torch.inference_mode():
        x = torch.randn(5, 8)
        truth_q = root.q_proj(x)
        with onednn_linears([root]):
            q = root.q_proj(x)
            x.mul_(3)  # an in-place change that an inference tensor's (missing) version cannot show
            k, v = root.k_proj(x), root.v_proj(x)
        truth_k, truth_v = root.k_proj(x), root.v_proj(x)  # the modules as they are, on the changed input
    torch.testing.assert_close(q, truth_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, truth_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, truth_v, atol=1e-5, rtol=1e-5)


def test_speedup_alternates_the_contenders_and_takes_the_median_ratio(monkeypatch):
    """The per-machine choices time both sides in alternated pairs, so a burst of load slows a pair's two calls
    alike: one slow baseline call (the burst) moves no answer, and a contender twice as fast reads 2."""
    clock, calls = [0.0], []
    monkeypatch.setattr(linears.time, "perf_counter", lambda: clock[0])
    baseline_times = iter([9.0, 2.0, 2.0, 50.0, 2.0, 2.0])  # the warm-up, then a burst in the third pair

    def baseline():
        calls.append("baseline")
        clock[0] += next(baseline_times)

    def contender():
        calls.append("contender")
        clock[0] += 1.0

    assert linears.speedup(baseline, contender, 5) == 2.0
    assert calls == ["baseline", "contender"] * 6
    assert linears.machine_key(dtype="x")["timing"] == linears.TIMING_METHOD  # choices timed another way re-time
