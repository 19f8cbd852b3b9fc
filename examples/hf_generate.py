#!/usr/bin/env python3
"""Greedy generation with a Hugging Face transformers model on pagedattn, checked against transformers' sdpa
(eager for architectures without sdpa support, e.g. Gemma-2).

The model is built from a real architecture's config with small dimensions and seeded random weights (nothing
is downloaded). Both implementations generate greedily from the same prompts; the script prints both
continuations and whether they agree.

    python examples/hf_generate.py --model gemma2 --device cpu --steps 32
    python examples/hf_generate.py --model llama --device cuda --batch     # generate_batch (continuous batching)
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys

import torch

VOCAB = 1000
PROMPT_LEN = 12
SLIDING_WINDOW = 16  # smaller than prompt + steps, so the window matters


def _config(model: str):
    """Small config of a real architecture: hidden 256, head_dim 64, GQA (4 query heads, 2 KV heads)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    if model == "llama":
        return tf.LlamaConfig(num_hidden_layers=2, **common)
    if model == "qwen2":
        return tf.Qwen2Config(num_hidden_layers=2, **common)
    if model == "mistral":
        return tf.MistralConfig(num_hidden_layers=2, sliding_window=SLIDING_WINDOW, **common)
    if model == "gemma2":
        # layers alternate sliding / full attention; soft cap on the attention logits and on the final logits
        # untied embeddings: with tied ones a random model keeps repeating its last input token
        return tf.Gemma2Config(num_hidden_layers=4, sliding_window=SLIDING_WINDOW, attn_logit_softcapping=50.0,
                               tie_word_embeddings=False,
                               final_logit_softcapping=30.0, query_pre_attn_scalar=64, **common)
    if model == "gpt_oss":
        # per-head attention sinks, alternating sliding / full layers, a small mixture of experts
        return tf.GptOssConfig(num_hidden_layers=2, sliding_window=SLIDING_WINDOW, num_local_experts=4,
                               num_experts_per_tok=2, **common)
    raise ValueError(f"unknown --model {model!r}; expected one of {', '.join(MODELS)}")


MODELS = ("llama", "qwen2", "mistral", "gemma2", "gpt_oss")


def _spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every weight with unit-gain scaling (std 1/sqrt(fan_in), embeddings std 1).

    transformers' default init (std 0.02) gives near-uniform logits, where any rounding difference flips a
    greedy choice; with unit-gain weights the logits are well separated and greedy tokens compare reliably.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[-1] if "embed" not in name else 1
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
            elif "sinks" in name:
                p.copy_(torch.randn(p.shape, generator=gen))


def reference_implementation(model: str) -> str:
    """transformers' sdpa, or eager for architectures that refuse sdpa (Gemma-2: its soft cap)."""
    import transformers as tf

    cls = tf.AutoModelForCausalLM._model_mapping[type(_config(model))]
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def build_model(model: str, attn_implementation: str, device: str, dtype: torch.dtype, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(model)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=torch.float32)
    _spread_weights(m, seed)
    return m.to(device=device, dtype=dtype).eval()


def prompts(batch: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, PROMPT_LEN), generator=gen).tolist()


def _greedy_config(steps: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                            pad_token_id=0)


def generate(model, inputs: list[list[int]], steps: int) -> list[list[int]]:
    """model.generate() over equal-length prompts; returns the new tokens of each prompt."""
    ids = torch.tensor(inputs, device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=_greedy_config(steps))
    return out[:, ids.shape[1]:].tolist()


def generate_batch(model, inputs: list[list[int]], steps: int, max_batch_tokens: int = 256) -> list[list[int]]:
    """model.generate_batch() (continuous batching over transformers' paged cache); new tokens per prompt."""
    from transformers import ContinuousBatchingConfig

    # Small pages, so each sequence spans several; no CUDA graphs and no async batching: the attention function
    # reads batch shapes on the host, which graph capture does not allow.
    params = inspect.signature(ContinuousBatchingConfig).parameters
    page = {"page_size" if "page_size" in params else "block_size": 16}
    cb = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=max_batch_tokens, use_cuda_graph=False,
                                  use_async_batching=False, **page)
    with torch.no_grad():
        results = model.generate_batch(inputs, generation_config=_greedy_config(steps),
                                       continuous_batching_config=cb, warmup=False)
    if len(results) != len(inputs):  # generate_batch logs and drops requests when its loop fails
        raise RuntimeError(f"generate_batch returned {len(results)} results for {len(inputs)} prompts")
    by_id = sorted(results.values(), key=lambda r: int(str(r.request_id).rsplit("_", 1)[-1]))
    return [list(r.generated_tokens)[:steps] for r in by_id]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="llama")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=2, help="number of prompts (batch size)")
    parser.add_argument("--batch", action="store_true", help="pagedattn through generate_batch (continuous batching)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                        help="default: float32 on cpu, float16 on cuda (CUDA_FLASH has no f32)")
    args = parser.parse_args(argv)

    from pagedattn.integrations import transformers as pa_tf

    name = pa_tf.register()
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "float16"))
    inputs = prompts(args.prompts)

    ref_name = reference_implementation(args.model)
    ref_model = build_model(args.model, ref_name, args.device, dtype)
    reference = generate(ref_model, inputs, args.steps)
    del ref_model
    model = build_model(args.model, name, args.device, dtype)
    ours = generate_batch(model, inputs, args.steps) if args.batch else generate(model, inputs, args.steps)

    path = "generate_batch" if args.batch else "generate"
    print(f"model={args.model} device={args.device} dtype={str(dtype).removeprefix('torch.')} steps={args.steps}")
    agree = len(reference) == len(ours) == len(inputs)
    for i, (a, b) in enumerate(zip(reference, ours)):
        same = a == b
        agree &= same
        print(f"prompt {i}: {inputs[i]}")
        print(f"  {ref_name:<9} generate      : {a}")
        print(f"  pagedattn {path:<14}: {b}")
        if not same:
            first = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y) if len(a) == len(b) else min(len(a), len(b))
            print(f"  first difference at step {first}")
    print("agree" if agree else "DISAGREE")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
