"""autofuse.fuse on tiny, randomly initialised Hugging Face models built from configs (no downloads)."""


import pytest
import torch
import transformers
from _helpers import relative_error, write_json
from click.testing import CliRunner

import autofuse
from autofuse.cli import main
from autofuse.hf import FusedHFMLP

# Relative error of the fused model's logits against the unfused model's, both in `dtype`. float32:
# both are float32 computations differing in summation order (~1e-6). 16-bit: each MLP rounds H
# once where eager rounds G, U, act(G) and their product separately, a few bf16/fp16 roundings
# (2**-8 / 2**-11) per layer that the next layers carry on; 2 layers stay well inside 4x the
# dtype's unit roundoff on the logits.
LOGIT_BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _gemma(**extra):
    config = transformers.GemmaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=64, hidden_activation="gelu_pytorch_tanh", **extra)
    return transformers.GemmaForCausalLM(config)


def _llama(**extra):
    config = transformers.LlamaConfig(**{**dict(vocab_size=128, hidden_size=64, intermediate_size=96,
                                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                 max_position_embeddings=64), **extra})
    return transformers.LlamaForCausalLM(config)


def _t5(**extra):
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=2,
                                   feed_forward_proj=extra.pop("feed_forward_proj", "gated-gelu"),
                                   dropout_rate=0.1, decoder_start_token_id=0, **extra)
    return transformers.T5ForConditionalGeneration(config)


MODELS = {"gemma": _gemma, "llama": _llama, "t5": _t5}


def _logits(model, ids):
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            return model(input_ids=ids, decoder_input_ids=ids[:, :5]).logits.float()
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", MODELS)
def test_fused_model_logits_match_the_original(family, dtype, monkeypatch, device):
    torch.manual_seed(0)
    model = MODELS[family]().to(device, dtype).eval()
    ids = torch.randint(0, 128, (2, 9), device=device)
    before = _logits(model, ids)
    report = autofuse.fuse(model, verbose=False)
    layers = 2 * (2 if family == "t5" else 1)  # T5: encoder and decoder blocks
    assert len(report.replaced) == layers and not report.skipped, report
    assert sum(isinstance(m, FusedHFMLP) for m in model.modules()) == layers
    fused_calls = []
    forward = autofuse.FusedMLP.forward
    monkeypatch.setattr(autofuse.FusedMLP, "forward", lambda self, x: fused_calls.append(1) or forward(self, x))
    after = _logits(model, ids)
    assert len(fused_calls) == layers  # the kernels ran, not the original modules
    assert relative_error(after, before.double()) <= LOGIT_BOUNDS[dtype]


@pytest.mark.parametrize("interleaved", [True, False])
def test_fused_modules_share_the_original_parameters_and_state_dict_keys(interleaved, device):
    model = _gemma().to(device).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    originals = {name: p for name, p in model.named_parameters()}
    ptrs = {name: p.data_ptr() for name, p in originals.items()}
    autofuse.fuse(model, verbose=False, interleaved=interleaved)
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # The same parameter objects (what an optimizer or a tied weight holds); interleaving moves the gate
    # and up weights' data into one buffer per block, not interleaving copies nothing.
    assert all(p is originals[name] for name, p in model.named_parameters())
    for layer in model.model.layers:
        gate, up = layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight
        shared = gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr()
        assert shared == interleaved and gate.is_contiguous() != interleaved
    assert interleaved or {name: p.data_ptr() for name, p in model.named_parameters()} == ptrs
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in _gemma().parameters())
    block = model.model.layers[0].mlp
    with torch.no_grad():  # an in-place weight change is seen by the fused forward
        block.up_proj.weight.mul_(0)
        assert torch.count_nonzero(block(torch.randn(3, 64, device=device))) == 0


def test_an_odd_intermediate_size_runs_in_padded_storage(device):
    # d_ff 93: rows of the down projection not 16-byte aligned; fuse lays the shared parameters out in
    # padded storage (autofuse/layout.py), values and state_dict unchanged, kept through .to().
    torch.manual_seed(0)
    model = _llama(intermediate_size=93).to(device).eval()
    ids = torch.randint(0, 128, (2, 9), device=device)
    before, state = _logits(model, ids), {k: v.clone() for k, v in model.state_dict().items()}
    autofuse.fuse(model, verbose=False)
    model = model.to(torch.bfloat16).to(torch.float32)
    down = model.model.layers[0].mlp.down_proj.weight
    assert down.shape == (64, 93) and down.stride() == (128, 1)
    after_state = model.state_dict()
    assert list(after_state) == list(state) and all(t.is_contiguous() for t in after_state.values())
    assert relative_error(_logits(model, ids), before.double()) <= LOGIT_BOUNDS[torch.bfloat16]


def test_generate_gives_the_same_tokens(device):
    torch.manual_seed(0)
    model = _llama().to(device).eval()
    ids = torch.randint(0, 128, (1, 6), device=device)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, **kwargs)
    autofuse.fuse(model, verbose=False)
    assert torch.equal(model.generate(ids, **kwargs), expected)


def test_the_report_names_what_was_left_alone():
    model = _t5(feed_forward_proj="relu")  # T5 v1.0: a non-gated feed-forward
    report = autofuse.fuse(model, verbose=False)
    assert not report.replaced
    assert len(report.skipped) == 4 and all("T5DenseActDense" in why for _, why in report.skipped)
    assert report.skipped[0][0] == "encoder.block.0.layer.1.DenseReluDense"
    assert "skipped  encoder.block.0.layer.1.DenseReluDense" in str(report)
    llama = _llama(hidden_act="relu")
    report = autofuse.fuse(llama, verbose=False)
    assert not report.replaced and all("activation ReLU" in why for _, why in report.skipped), report


def test_fusing_twice_changes_nothing():
    model = _gemma()
    autofuse.fuse(model, verbose=False)
    report = autofuse.fuse(model, verbose=False)
    assert not report.replaced and [why for _, why in report.skipped] == ["already fused"] * 2


def test_the_original_forward_runs_where_the_kernels_would_differ(device):
    # T5 in training with dropout, inputs of another dtype, autocast: the original module runs.
    model = _t5().to(device).eval()
    autofuse.fuse(model, verbose=False)
    assert not model.encoder.block[0].layer[1].DenseReluDense.training  # fused in the model's mode
    block = model.encoder.block[0].layer[1].DenseReluDense
    x = torch.randn(4, 64, device=device)
    model.train()
    assert block._needs_original(x)
    model.eval()
    assert not block._needs_original(x)
    assert block._needs_original(x.double())
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        assert block._needs_original(x)


def test_tune_model_tunes_the_fused_model_shapes(device):
    model = _gemma().to(device).eval()
    autofuse.fuse(model, verbose=False)
    # gated_up, gated_pairs, down, mlp: one shape, one M
    assert autofuse.tune_model(model, tokens=(16,), trials=1) == 4
    sources = model.model.layers[0].mlp._fused.config_sources(16)
    assert sources and all(s == "user-cache" for s in sources.values()), sources


def test_tune_model_derives_the_shapes_from_a_config(tmp_path):
    config = _gemma().config.to_dict()
    write_json(tmp_path / "config.json", config)
    result = CliRunner().invoke(main, ["tune", "--model", str(tmp_path), "--tokens", "8", "--trials", "1",
                                       "--dtype", "float32"])
    assert result.exit_code == 0, result.output
    assert "gemma gated_up" in result.output and "gemma down" in result.output


@pytest.mark.parametrize("config, message", [
    ({"model_type": "t5", "d_model": 64, "d_ff": 96, "feed_forward_proj": "relu"}, "non-gated feed-forward"),
    ({"model_type": "bert", "hidden_size": 64}, "no intermediate_size"),
    ({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "hidden_act": "tanh"}, "unknown activation"),
])
def test_tune_model_rejects_configs_it_cannot_fuse_in_one_line(tmp_path, config, message):
    path = write_json(tmp_path / "config.json", config)
    result = CliRunner().invoke(main, ["tune", "--model", str(path), "--tokens", "8"])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_tune_needs_exactly_one_source(tmp_path):
    result = CliRunner().invoke(main, ["tune"])
    assert result.exit_code == 2 and "--shapes FILE, --model CONFIG or --traffic TRACE" in result.output


def test_fusing_a_lone_mlp_is_refused_clearly():
    mlp = _gemma().model.layers[0].mlp
    with pytest.raises(autofuse.AutofuseError, match="call it on the model"):
        autofuse.fuse(mlp, verbose=False)


def test_fusing_on_a_cpu_without_the_interpreter_says_the_originals_run():
    import os
    import subprocess
    import sys

    code = (
        "import logging, torch, transformers, autofuse\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,\n"
        "    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)\n"
        "model = transformers.LlamaForCausalLM(config)\n"
        "report = autofuse.fuse(model, verbose=False)\n"
        "print('REPORT', str(report).replace(chr(10), ' | '))\n"
        "model(torch.tensor([[1, 2, 3]]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "replaced 2 MLP block(s)" in done.stdout and "note: the model is on the CPU" in done.stdout
    assert done.stderr.count("until it moves to a GPU, the replaced modules run their original forwards") == 1
