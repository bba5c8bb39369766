"""Op rms_norm and FusedRMSNorm: the kernel against float64, its bound launches against the JIT path, the
eager fallbacks, and fuse(model) recognising Hugging Face RMSNorms by what they compute."""

import pytest
import torch
import transformers
from _helpers import DTYPES, TOLERANCES, assert_matches_reference
from torch import nn

import autofuse
from autofuse import launch, ops
from autofuse.errors import AutofuseError
from autofuse.hf import _recognise_norm
from autofuse.norm import FusedRMSNorm
from autofuse.ops.rms_norm import FORMS, eager_rms_norm, rms_norm

RMS_NORM = ops.get("rms_norm")


def _inputs(M, N, dtype, device):
    # Rows of mixed scale (the statistics must follow each row), weights around Gemma's and Llama's values.
    x = (torch.randn(M, N, device=device) * torch.rand(M, 1, device=device) * 8).to(dtype)
    w = (1 + 0.5 * torch.randn(N, device=device)).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("M,N", [(1, 64), (7, 100), (40, 257), (3, 1)])
def test_kernel_matches_float64(M, N, form, dtype, device):
    x, w = _inputs(M, N, dtype, device)
    eps = 1e-6
    out = rms_norm(x, w, eps, form)
    ref = RMS_NORM.reference({"x": x, "w": w, "eps": eps}, form, dtype)
    # "weight" rounds x_hat to the dtype before the product (as the modules do) and the product again: two
    # roundings where TOLERANCES allows for one, so its band is doubled; the error is still checked
    # against eager PyTorch's own (assert_matches_reference's second check).
    tolerances = {k: 2 * v for k, v in TOLERANCES[dtype].items()} if form == "weight" else None
    assert_matches_reference(out, ref, eager_rms_norm(x, w, eps, form), tolerances)


def test_kernel_takes_strided_rows_and_writes_into_out(device):
    x, w = _inputs(6, 48, torch.float32, device)
    wide = torch.randn(6, 96, device=device)
    wide[:, ::2] = x
    out = torch.full((6, 48), float("nan"), device=device)
    got = rms_norm(wide[:, ::2], w, 1e-5, "weight", out=out)
    assert got is out
    torch.testing.assert_close(out, eager_rms_norm(x, w, 1e-5, "weight"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("form", FORMS)
def test_module_replays_a_bound_launch_bit_identical_to_the_jit_path(form, dtype, device, monkeypatch):
    x, w = _inputs(5, 72, dtype, device)
    norm = FusedRMSNorm(nn.Parameter(w), 1e-6, form)
    x3 = x.view(5, 1, 72)
    with torch.no_grad():
        first = norm(x3)
        assert first.shape == x3.shape
        bound = norm._bound[5][2]
        assert bound is not None  # the first call at M=5 bound its launch
        calls = []
        real = bound.__call__
        monkeypatch.setattr(type(bound), "__call__", lambda self, t: calls.append(1) or real(t))
        again = norm(x3)
    assert calls == [1]  # the second call replayed the bound launch
    assert torch.equal(first, again)
    assert torch.equal(again.view(5, 72), rms_norm(x, w, 1e-6, form))


def test_module_binds_again_after_the_weight_moves_and_sees_in_place_edits(device):
    x, w = _inputs(3, 40, torch.float32, device)
    norm = FusedRMSNorm(nn.Parameter(w.clone()), 1e-6, "weight")
    with torch.no_grad():
        norm(x)
        norm.weight.mul_(2)  # in place: the bound address reads the new values
        torch.testing.assert_close(norm(x), eager_rms_norm(x, 2 * w, 1e-6, "weight"), rtol=1e-5, atol=1e-6)
        norm.weight = nn.Parameter(3 * w)  # a new parameter: another address, bound again
        torch.testing.assert_close(norm(x), eager_rms_norm(x, 3 * w, 1e-6, "weight"), rtol=1e-5, atol=1e-6)
        assert norm._bound[3][0] == norm.weight.data_ptr()
        norm.eps = 1.0  # eps is a constant of the kernel: a change builds another
        torch.testing.assert_close(norm(x), eager_rms_norm(x, 3 * w, 1.0, "weight"), rtol=1e-5, atol=1e-6)


def test_module_runs_the_eager_form_for_autograd_and_other_dtypes(device, monkeypatch):
    x, w = _inputs(4, 32, torch.float32, device)
    norm = FusedRMSNorm(nn.Parameter(w.clone()), 1e-6, "one_plus_weight")
    launched = []
    monkeypatch.setattr(launch, "launch", lambda *a, **k: launched.append(a))
    x.requires_grad_(True)
    out = norm(x)  # autograd: the kernel has no backward
    out.square().sum().backward()
    expected_x, expected_w = x.detach().clone().requires_grad_(True), w.clone().requires_grad_(True)
    eager_rms_norm(expected_x, expected_w, 1e-6, "one_plus_weight").square().sum().backward()
    torch.testing.assert_close(x.grad, expected_x.grad)
    torch.testing.assert_close(norm.weight.grad, expected_w.grad)
    with torch.no_grad():
        assert norm(x.detach().double()).dtype == torch.float64  # another dtype: PyTorch's promotion, as the original
        with pytest.raises(RuntimeError):
            norm(torch.randn(4, 31, device=device))  # a wrong width fails as the original module fails
    assert not launched


def test_module_refuses_an_unknown_form():
    with pytest.raises(ValueError, match="form must be one of"):
        FusedRMSNorm(nn.Parameter(torch.ones(4)), 1e-6, "layer_norm")


def test_module_under_torch_compile_traces_the_eager_form(device):
    x, w = _inputs(4, 32, torch.float32, device)
    norm = FusedRMSNorm(nn.Parameter(w), 1e-6, "weight")
    compiled = torch.compile(norm, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), eager_rms_norm(x, w, 1e-6, "weight"))


class _MeanSubtractingNorm(nn.Module):
    """Named like an RMSNorm, computes a LayerNorm without bias: fuse must leave it alone."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = 1e-6

    def forward(self, x):
        return nn.functional.layer_norm(x, x.shape[-1:], self.weight, None, self.eps)


_MeanSubtractingNorm.__name__ = "CustomRMSNorm"


def test_hf_norms_are_recognised_by_what_they_compute():
    gemma = transformers.models.gemma.modeling_gemma.GemmaRMSNorm(48, eps=1e-6)
    llama = transformers.models.llama.modeling_llama.LlamaRMSNorm(48, eps=1e-5)
    t5 = transformers.models.t5.modeling_t5.T5LayerNorm(48, eps=1e-6)
    assert _recognise_norm(gemma) == ("one_plus_weight", 1e-6)
    assert _recognise_norm(llama) == ("weight", 1e-5)
    assert _recognise_norm(t5) == ("weight", 1e-6)
    assert "neither of autofuse's RMSNorm forms" in _recognise_norm(_MeanSubtractingNorm(48))
    assert _recognise_norm(nn.LayerNorm(48, bias=False)) is None  # not an RMSNorm: not even reported
    assert _recognise_norm(nn.LayerNorm(48)) is None
    assert _recognise_norm(nn.Linear(4, 4)) is None


def _gemma():
    config = transformers.GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=64, hidden_activation="gelu_pytorch_tanh")
    return transformers.GemmaForCausalLM(config)


def test_fuse_replaces_the_norms_sharing_their_weights(device):
    model = _gemma().to(device).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_()  # Gemma starts its norm weights at zero; trained ones are not
    ids = torch.randint(0, 128, (2, 7), device=device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    with torch.no_grad():
        before = model(input_ids=ids).logits
    report = autofuse.fuse(model, verbose=False)
    assert len(report.norms) == 5 and not report.skipped  # two per layer and the final norm
    assert all(what.endswith("one_plus_weight") for _, what in report.norms)
    assert "and 5 RMSNorm(s)" in str(report)
    assert isinstance(model.model.layers[0].input_layernorm, FusedRMSNorm)
    assert list(model.state_dict()) == list(state)
    assert all(p is params[name] for name, p in model.named_parameters())
    with torch.no_grad():
        after = model(input_ids=ids).logits
    # float32 throughout: summation order only.
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    again = autofuse.fuse(model, verbose=False)
    assert not again.norms


def test_fuse_leaves_norms_alone_when_asked_and_reports_those_it_cannot_run():
    model = _gemma()
    report = autofuse.fuse(model, verbose=False, norms=False)
    assert not report.norms and len(report.replaced) == 2
    assert not any(isinstance(m, FusedRMSNorm) for m in model.modules())
    model.model.norm = _MeanSubtractingNorm(64)
    report = autofuse.fuse(model, verbose=False)
    assert len(report.norms) == 4
    assert ("model.norm", "it computes neither of autofuse's RMSNorm forms (weight, one_plus_weight)") in report.skipped
    assert isinstance(model.model.norm, _MeanSubtractingNorm)


def test_show_kernel_renders_both_forms():
    for form in FORMS:
        source = autofuse.show_kernel("rms_norm", activation=form)
        assert f"def autofuse_rms_norm_{form}(" in source and "tl.rsqrt" in source
    with pytest.raises(AutofuseError, match="choose one of weight, one_plus_weight"):
        autofuse.show_kernel("rms_norm", activation="gelu")
