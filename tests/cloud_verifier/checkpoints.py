"""Writing small checkpoints for the loader tests: a byte-level BPE vocabulary, GGUF files laid out
as llama.cpp's converter lays them out (q/k rows permuted for `llama`), and Hugging Face
safetensors directories."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from shared.model.llama import LlamaModel, inverse_frequencies
from shared.model.model_config import ModelConfig
from shared.model.tokenizer import CONTROL, bpe_from_gguf
from shared.model.weights import hf_state_dict

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a n", "Ġ in"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_chars() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def small_vocab() -> tuple[list[str], list[int]]:
    """Tokens (specials, the 256 bytes, the merges' results) and their llama.cpp token types."""
    tokens = SPECIALS + byte_chars() + [m.replace(" ", "") for m in MERGES]
    types = [CONTROL] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows of `llama` models (halves -> adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, model: LlamaModel, arch: str = "llama", quant: str | None = None) -> None:
    """`model` as a GGUF with a small BPE vocabulary; `quant` ("Q8_0", ...): its matrices (the
    projections and the token table) stored as gguf-py quantizes them, the norms and biases F32."""
    import gguf
    from gguf.quants import quantize

    c = model.config
    tokens, types = small_vocab()
    assert c.vocab_size == len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)

    def add(gguf_name: str, arr: np.ndarray) -> None:
        if quant is None or arr.ndim != 2:
            w.add_tensor(gguf_name, arr)
            return
        kind = gguf.GGMLQuantizationType[quant]
        w.add_tensor(gguf_name, quantize(arr.astype(np.float32), kind), raw_dtype=kind)

    for name, t in hf_state_dict(model).items():
        arr = t.float().numpy()
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", arr)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", arr)
        elif name == "lm_head.weight":
            add("output.weight", arr)
        else:
            _, _, layer, part = name.split(".", 3)
            if arch == "llama" and part.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                arr = llama_cpp_permute(arr, c.num_heads if ".q_proj" in part else c.num_kv_heads)
            add(f"blk.{layer}.{_GGUF_BLOCK[part]}", arr)
    if c.rope_scaling is not None:
        # llama.cpp stores Llama 3 scaling as per-frequency divisors
        base = inverse_frequencies(dataclasses.replace(c, rope_scaling=None))
        w.add_tensor("rope_freqs.weight", (base / inverse_frequencies(c)).numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_hf_dir(directory: Path, model: LlamaModel, model_type: str = "llama") -> None:
    from safetensors.torch import save_file

    c = model.config
    directory.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(model), str(directory / "model.safetensors"))
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position,
        "tie_word_embeddings": c.tie_embeddings,
        "attention_bias": c.qkv_bias,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if c.rope_scaling is not None:
        sc = c.rope_scaling
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": sc.factor,
            "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor,
            "original_max_position_embeddings": sc.original_max_position,
        }
    (directory / "config.json").write_text(json.dumps(cfg))
    tokens, types = small_vocab()
    tok = bpe_from_gguf(tokens, MERGES, types, "default", 1, False)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"})
    )


def logits_of(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """[len, vocab] logits of a causal pass over `tokens` from an empty cache."""
    from shared.model import prefill_chunk

    kv = model.new_kv_cache(8, 16)
    kv.add(0)
    x = prefill_chunk(0, tokens, 0, logits_last=False)
    x.logit_rows = torch.arange(len(tokens))
    (out,) = model.forward_packed([x], kv)
    return out


def config_for(kind: str, vocab: int) -> ModelConfig:
    from shared.model import RopeScaling, make_tiny_config

    if kind == "llama":
        return make_tiny_config(vocab)
    if kind == "llama3-untied":
        return make_tiny_config(
            vocab,
            tie_embeddings=False,
            rope_theta=500000.0,
            rope_scaling=RopeScaling(original_max_position=64),
        )
    if kind == "qwen2":
        return make_tiny_config(
            vocab, qkv_bias=True, tie_embeddings=False, architecture="qwen2", rms_norm_eps=1e-6
        )
    raise ValueError(kind)
