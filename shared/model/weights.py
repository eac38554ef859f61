"""Building a LlamaModel and filling it: seeded random weights, or tensors named as in Hugging Face
checkpoints (the GGUF loader renames llama.cpp's tensors to these names first).

The model stores q|k|v and gate|up fused; `WeightAssigner` copies each checkpoint tensor into its
slice and refuses to finish while any slice is still unset, so a checkpoint missing a tensor fails
loudly instead of running on uninitialised memory.
"""

from __future__ import annotations

import re

import torch

from shared.model.llama import DecoderLayer, LlamaModel
from shared.model.model_config import ModelConfig


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (exact greedy verification), bfloat16 on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    names |= {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be auto or one of {sorted(names)}, got {dtype!r}")
    return names[dtype]


def build_model(
    config: ModelConfig,
    seed: int | None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
) -> LlamaModel:
    """A LlamaModel with seeded random weights, or uninitialised ones (seed None) for a loader."""
    dev = resolve_device(device)
    model = LlamaModel(config, resolve_dtype(dtype, dev), dev)
    if seed is not None:
        init_random(model, seed)
    return model


def init_random(model: LlamaModel, seed: int) -> None:
    """Weights scaled so activations keep unit size and logits have a spread of a few units,
    which keeps greedy choices well separated in tests (std 0.02 everywhere would make every
    logit nearly equal and hide errors)."""
    gen = torch.Generator().manual_seed(seed)

    def fill(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=gen) * std + mean)

    c = model.config
    fill(model.embed, 0.3)
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        fill(layer.attn_norm, 0.1, 1.0)
        fill(layer.qkv, c.hidden_size**-0.5)
        if layer.qkv_bias is not None:
            fill(layer.qkv_bias, 0.1)
        fill(layer.o, c.q_size**-0.5)
        fill(layer.mlp_norm, 0.1, 1.0)
        fill(layer.gate_up, c.hidden_size**-0.5)
        fill(layer.down, c.intermediate_size**-0.5)
    fill(model.norm, 0.1, 1.0)
    if not c.tie_embeddings:
        fill(model.lm_head, 0.3)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class WeightAssigner:
    """Copies Hugging Face-named tensors into a LlamaModel's (fused) parameters."""

    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        c = model.config
        self.missing: set[str] = {"model.embed_tokens.weight", "model.norm.weight"}
        if not c.tie_embeddings:
            self.missing.add("lm_head.weight")
        parts = [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        ]
        if c.qkv_bias:
            parts += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        for i in range(c.num_layers):
            self.missing.update(f"model.layers.{i}.{p}" for p in parts)

    def target(self, name: str) -> torch.Tensor | None:
        """The parameter slice `name` fills, or None for a tensor this model does not use."""
        m, c = self.model, self.model.config
        if name == "model.embed_tokens.weight":
            return m.embed
        if name == "model.norm.weight":
            return m.norm
        if name == "lm_head.weight":
            return None if c.tie_embeddings else m.lm_head
        hit = _LAYER.match(name)
        if not hit or int(hit.group(1)) >= c.num_layers:
            return None
        layer = m.layers[int(hit.group(1))]
        assert isinstance(layer, DecoderLayer)
        q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
        qkv_rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
        part = hit.group(2)
        simple = {
            "input_layernorm.weight": layer.attn_norm,
            "post_attention_layernorm.weight": layer.mlp_norm,
            "self_attn.o_proj.weight": layer.o,
            "mlp.down_proj.weight": layer.down,
            "mlp.gate_proj.weight": layer.gate_up[:inter],
            "mlp.up_proj.weight": layer.gate_up[inter:],
        }
        if part in simple:
            return simple[part]
        proj, _, kind = part.removeprefix("self_attn.").partition(".")
        if proj in qkv_rows:
            a, b = qkv_rows[proj]
            if kind == "weight":
                return layer.qkv[a:b]
            if kind == "bias" and layer.qkv_bias is not None:
                return layer.qkv_bias[a:b]
        return None

    def assign(self, name: str, value: torch.Tensor) -> bool:
        """Copy `value` into its slice; False when the model has no place for it."""
        dst = self.target(name)
        if dst is None:
            return False
        if tuple(dst.shape) != tuple(value.shape):
            raise ValueError(
                f"{name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(dst.shape)}"
            )
        dst.copy_(value)
        self.missing.discard(name)
        return True

    def finish(self) -> None:
        if self.missing:
            shown = ", ".join(sorted(self.missing)[:5])
            raise ValueError(f"checkpoint lacks {len(self.missing)} tensor(s) the model needs: {shown}")


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names, fused tensors split again (for saving a
    safetensors checkpoint that transformers and `load_target` both read)."""
    model._check_weights("hf_state_dict")
    c = model.config
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm}
    if not c.tie_embeddings:
        out["lm_head.weight"] = model.lm_head
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = layer.attn_norm
        out[p + "post_attention_layernorm.weight"] = layer.mlp_norm
        out[p + "self_attn.q_proj.weight"] = layer.qkv[:q]
        out[p + "self_attn.k_proj.weight"] = layer.qkv[q : q + kv]
        out[p + "self_attn.v_proj.weight"] = layer.qkv[q + kv :]
        if layer.qkv_bias is not None:
            out[p + "self_attn.q_proj.bias"] = layer.qkv_bias[:q]
            out[p + "self_attn.k_proj.bias"] = layer.qkv_bias[q : q + kv]
            out[p + "self_attn.v_proj.bias"] = layer.qkv_bias[q + kv :]
        out[p + "self_attn.o_proj.weight"] = layer.o
        out[p + "mlp.gate_proj.weight"] = layer.gate_up[:inter]
        out[p + "mlp.up_proj.weight"] = layer.gate_up[inter:]
        out[p + "mlp.down_proj.weight"] = layer.down
    return {k: v.detach().contiguous().clone() for k, v in out.items()}
