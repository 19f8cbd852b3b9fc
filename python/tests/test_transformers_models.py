"""Real transformers architectures on pagedattn: greedy tokens match transformers' own attention.

Small configs of real architectures with seeded unit-gain random weights (examples/hf_generate.py builds them),
32 greedy steps, pagedattn against sdpa (eager where the architecture has no sdpa, e.g. Gemma-2 with some
transformers versions). CPU runs f32 (CPU_ATTN): every token must agree. CUDA runs f16 (CUDA_FLASH has no
f32, and f16 rounds 8x finer than bf16): every token must agree up to a tie, a step where the f32 reference's
top two logits are within f16's resolution (F16_TIE_MARGIN), and at least one prompt must agree throughout.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not importable")
transformers = pytest.importorskip("transformers", reason="transformers is not importable")

from pagedattn.integrations import transformers as pa_tf  # noqa: E402

STEPS = 32
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_generate.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("hf_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hf = _load_example()

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")),
]


def _dtype(device):
    return torch.float32 if device == "cpu" else torch.float16


@pytest.fixture(scope="module")
def name():
    return pa_tf.register()


# f16 (CUDA) only: a first difference is accepted when the two tokens are the f32 reference's top two and
# their logits lie within this of each other there, a tie at f16's resolution (its spacing is 2e-3 for logits
# of 2 to 4, the size these models produce). Everything after a tie is a different continuation and is not
# compared. f32 (CPU) runs must agree at every step.
F16_TIE_MARGIN = 5e-3


def _tie_margin(model_name, device, prefix, want, got):
    """The f32 reference's top-two logit gap after `prefix` when {want, got} are its top two, else None."""
    model = hf.build_model(model_name, hf.reference_implementation(model_name), device, torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prefix], device=device)).logits[0, -1]
    top = torch.topk(logits, 2)
    if set(top.indices.tolist()) != {want, got}:
        return None
    return float(top.values[0] - top.values[1])


def _assert_same_greedy(model_name, device, inputs, expected, got, steps):
    assert len(got) == len(expected) == len(inputs)
    full = 0
    for i, (prompt, e, g) in enumerate(zip(inputs, expected, got)):
        assert len(g) == steps, f"prompt {i}: {len(g)} tokens"
        if g == e:
            full += 1
            continue
        j = next(j for j in range(steps) if e[j] != g[j])
        margin = _tie_margin(model_name, device, prompt + e[:j], e[j], g[j]) if device != "cpu" else None
        assert margin is not None and margin < F16_TIE_MARGIN, (
            f"prompt {i}: first difference at step {j} ({g[j]} instead of {e[j]}), not a tie of the f32 reference "
            f"(top-two gap {margin})")
        print(f"{model_name} {device} prompt {i}: tie at step {j} (f32 reference top-two gap {margin:.5f}); "
              f"identical before it")
    assert full > 0, "no prompt matched over every step"


def _check(model_name, device, path, name, num_prompts=4):
    inputs = hf.prompts(num_prompts)
    ref_model = hf.build_model(model_name, hf.reference_implementation(model_name), device, _dtype(device))
    expected = hf.generate(ref_model, inputs, STEPS)
    del ref_model
    model = hf.build_model(model_name, name, device, _dtype(device))
    run = hf.generate_batch if path == "generate_batch" else hf.generate
    _assert_same_greedy(model_name, device, inputs, expected, run(model, inputs, STEPS), STEPS)


@pytest.mark.parametrize("path", ["generate", "generate_batch"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_name", ["llama", "gemma2"])
def test_greedy_matches_reference(model_name, device, path, name):
    if model_name == "gemma2":
        # the window must cut into the context for the sliding layers to be tested
        assert hf.SLIDING_WINDOW < hf.PROMPT_LEN + STEPS
    _check(model_name, device, path, name)


@pytest.mark.parametrize("path", ["generate", "generate_batch"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_name", ["mistral", "qwen2", "gpt_oss"])
def test_greedy_matches_reference_more_architectures(model_name, device, path, name):
    _check(model_name, device, path, name)


@pytest.mark.parametrize("device", DEVICES)
def test_left_padded_generate(device, name):
    """Prompts of different lengths, left-padded: the padding mask becomes per-row block tables."""
    inputs = [[0, 0, 0, 0] + list(range(5, 13)), list(range(1, 13))]
    ids = torch.tensor(inputs, device=device)
    mask = torch.tensor([[0] * 4 + [1] * 8, [1] * 12], device=device)
    outs = []
    for impl in (hf.reference_implementation("gemma2"), name):
        model = hf.build_model("gemma2", impl, device, _dtype(device))
        with torch.no_grad():
            outs.append(model.generate(ids, attention_mask=mask, generation_config=hf._greedy_config(20))[:, 12:])
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_name", ["llama", "gemma2"])
def test_chunked_prefill_generate_batch(model_name, device, name):
    """40-token prompts through 16-token batches: prefill continues over cached chunks, and on sliding layers
    a chunk may overwrite ring slots it still reads (the gather fallback)."""
    gen = torch.Generator().manual_seed(3)
    inputs = torch.randint(1, hf.VOCAB, (2, 40), generator=gen).tolist()
    ref_model = hf.build_model(model_name, hf.reference_implementation(model_name), device, _dtype(device))
    expected = hf.generate(ref_model, inputs, 20)
    model = hf.build_model(model_name, name, device, _dtype(device))
    _assert_same_greedy(model_name, device, inputs, expected, hf.generate_batch(model, inputs, 20, max_batch_tokens=16),
                        20)


def test_unsupported_arguments_raise(name):
    model = hf.build_model("llama", name, "cpu", torch.float32)
    attn = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 3, 64)
    k = torch.randn(1, 2, 3, 64)
    with pytest.raises(NotImplementedError, match="dropout"):
        pa_tf.attention_forward(attn, q, k, k, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="output_attentions"):
        pa_tf.attention_forward(attn, q, k, k, None, output_attentions=True)
    with pytest.raises(NotImplementedError, match="4-D attention_mask"):
        pa_tf.attention_forward(attn, q, k, k, torch.zeros(1, 1, 3, 3))
    with pytest.raises(ValueError, match="sliding_window"):
        pa_tf.attention_forward(attn, q, k, k, None, sliding_window=0)
