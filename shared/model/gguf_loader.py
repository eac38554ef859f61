"""Loading a GGUF file: config from metadata, weights dequantized to float (or, with quantized
weights, the projections kept as blocks: `load_gguf_quantized`), tokenizer and template.

llama.cpp's converter stores the q and k projections of `llama` models with their rows permuted
per head (it evaluates RoPE on adjacent pairs, Hugging Face on the two halves of a head); the rows
are permuted back here so every loader yields Hugging Face's layout. `qwen2` files are not
permuted (llama.cpp runs those with the half-split RoPE).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from shared.gguf_check import GGUFHeader, check_gguf
from shared.model.archs import Architecture, by_name
from shared.model.llama import LlamaModel
from shared.model.model_config import ModelConfig, RopeScaling
from shared.model.quantized import QuantMatrix, QuantPart, gguf_part
from shared.model.tokenizer import CONTROL, TargetTokenizer, bpe_from_gguf
from shared.model.weights import WeightAssigner
from shared.vocab import end_of_generation_ids
from treespec_kernels.quant_matmul import QTYPES


def open_gguf(path: str | Path) -> Any:
    """gguf-py's reader of `path`, once the file has passed `shared.gguf_check` (its header against
    its tensors and size) and holds every tensor this runtime's model of its architecture reads:
    nothing is allocated from a header that the file does not back (GGUFError, one line)."""
    from gguf import GGUFReader

    check_model_file(check_gguf(path))
    return GGUFReader(str(path))


def check_model_file(header: GGUFHeader) -> None:
    """Refuse a checked GGUF whose architecture the model code does not run, that gives no
    vocabulary size, or that lacks a tensor the model reads: every tensor of the architecture's
    table but the untied head, the q/k/v biases only when the first block has one."""
    try:
        arch = by_name(header.architecture, "GGUF general.architecture")
    except ValueError as exc:
        raise header.error(str(exc)) from None
    meta = header.metadata
    if f"{arch.name}.vocab_size" not in meta and "tokenizer.ggml.tokens" not in meta:
        raise header.error(f"neither {arch.name}.vocab_size nor tokenizer.ggml.tokens is present")
    biases = "blk.0.attn_q.bias" in header.tensors
    block = [n for n in arch.gguf_block if n.endswith(".weight") or biases]
    header.require([n for n, hf in arch.gguf_top.items() if hf != "lm_head.weight"], block)


def field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_name(gguf_name: str, arch: Architecture | None = None) -> str | None:
    """The Hugging Face name of a llama.cpp tensor (the architecture's table; default llama's)."""
    arch = arch or by_name("llama")
    if gguf_name in arch.gguf_top:
        return arch.gguf_top[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in arch.gguf_block:
        return f"model.layers.{parts[1]}.{arch.gguf_block[parts[2]]}"
    return None


def config_from_gguf(reader: Any) -> ModelConfig:
    arch = by_name(str(field(reader, "general.architecture")), "GGUF general.architecture").name

    def key(name: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{name}", default)

    names = {t.name for t in reader.tensors}
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = key("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling = None
    if "rope_freqs.weight" in names:
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        scaling = RopeScaling(kind="llama3", freq_factors=tuple(float(x) for x in np.asarray(freqs.data)))
    elif key("rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor")))
    elif key("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {key('rope.scaling.type')!r} is not supported")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length", hidden // heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        max_position=int(key("context_length", 8192)),
        architecture=arch,
    )


def tokenizer_from_gguf(reader: Any, path: str | Path) -> TargetTokenizer:
    tokens = [str(t) for t in field(reader, "tokenizer.ggml.tokens")]
    kind = field(reader, "tokenizer.ggml.model")
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    types = field(reader, "tokenizer.ggml.token_type")
    eos = end_of_generation_ids(
        (field(reader, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")),
        tokens,
        [] if types is None else [i for i, k in enumerate(types) if k == CONTROL],
    )
    template = field(reader, "tokenizer.chat_template")
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", False))
    if kind == "gpt2":
        tok = bpe_from_gguf(
            tokens,
            [str(m) for m in field(reader, "tokenizer.ggml.merges", [])],
            types,
            field(reader, "tokenizer.ggml.pre"),
            None if bos is None else int(bos),
            add_bos,
        )
    else:  # SentencePiece-style vocabularies: let transformers convert them
        from transformers import AutoTokenizer

        p = Path(path)
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name).backend_tokenizer
    return TargetTokenizer(tok, tokens, template, None if bos is None else int(bos), eos)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q/k: rows (d/2 pairs of 2) -> (2 halves of d/2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_weights(reader: Any, model: LlamaModel, progress: bool = True) -> None:
    from gguf.quants import dequantize

    c = model.config
    assigner = WeightAssigner(model)
    arch = by_name(c.architecture)
    permute = arch.gguf_qk_permuted
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", disable=not progress):
        name = hf_name(t.name, arch)
        if name is None:
            continue
        arr = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape.tolist())])
        if permute and (".q_proj." in name or ".k_proj." in name):
            arr = unpermute_rows(arr, c.num_heads if ".q_proj." in name else c.num_kv_heads)
        assigner.assign(name, torch.from_numpy(np.array(arr, dtype=np.float32)))
    assigner.finish()


def fill_from_gguf(reader: Any, model: LlamaModel, write: Callable[[str, torch.Tensor], None]) -> None:
    """Dequantize `reader`'s tensors into `model`'s (uninitialised) parameters one at a time, and
    hand each parameter to `write(name, tensor)` as soon as every tensor that fills it has arrived,
    then free it: the whole model is never in memory (weight_cache.save's `fill`, the first start
    of a streamed target larger than memory). Peak: about one layer's fused parameters."""
    from gguf.quants import dequantize

    c = model.config
    assigner = WeightAssigner(model)
    arch = by_name(c.architecture)
    permute = arch.gguf_qk_permuted
    params = dict(model.named_parameters(remove_duplicate=True))
    spans = {n: (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for n, p in params.items()}

    def owner(view: torch.Tensor) -> str:
        ptr = view.data_ptr()
        return next(n for n, (a, b) in spans.items() if a <= ptr < b)

    waiting: dict[str, set[str]] = {}
    for hf in assigner.missing:
        dst = assigner.target(hf)
        assert dst is not None
        waiting.setdefault(owner(dst), set()).add(hf)
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None or name not in assigner.missing:
            continue
        arr = dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape.tolist())])
        if permute and (".q_proj." in name or ".k_proj." in name):
            arr = unpermute_rows(arr, c.num_heads if ".q_proj." in name else c.num_kv_heads)
        dst = assigner.target(name)
        assert dst is not None
        param = owner(dst)
        assigner.assign(name, torch.from_numpy(np.array(arr, dtype=np.float32)))
        waiting[param].discard(name)
        if not waiting[param]:
            write(param, params[param])
            params[param].data = params[param].data.new_empty(0)  # written: give its memory back
    assigner.finish()
    if any(waiting.values()):
        raise ValueError(f"tensors never read: {sorted(n for w in waiting.values() for n in w)[:5]}")


# Where each projection goes in a layer's (q|k|v, o, gate|up, down) and its place in the fused part
_PROJECTIONS = {
    "self_attn.q_proj.weight": (0, 0),
    "self_attn.k_proj.weight": (0, 1),
    "self_attn.v_proj.weight": (0, 2),
    "self_attn.o_proj.weight": (1, 0),
    "mlp.gate_proj.weight": (2, 0),
    "mlp.up_proj.weight": (2, 1),
    "mlp.down_proj.weight": (3, 0),
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def unquantizable(reader: Any) -> str | None:
    """The first projection of a GGUF whose type the quantized kernels cannot read ("blk.0.ffn_down.weight
    is IQ4_XS"), or None when every one can (what `--weights auto` checks before choosing them)."""
    arch = by_name(config_from_gguf(reader).architecture)
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        hit = None if name is None else _LAYER_NAME.fullmatch(name)
        if hit is not None and hit.group(2) in _PROJECTIONS and t.tensor_type.name not in QTYPES:
            return f"{t.name} is {t.tensor_type.name}"
    return None


def load_gguf_quantized(reader: Any, model: LlamaModel, progress: bool = True) -> None:
    """`--weights quantized`: the projections, the head and a quantized token table stay GGUF
    blocks (shared/model/quantized.py; no float copy is made), the rest (norms, biases, a float
    table) is read as floats. Every projection must be of a type the kernels read (Q8_0, Q5_0,
    Q4_1, Q4_K, Q6_K); otherwise a ValueError says to use --weights fp32."""
    from gguf.quants import dequantize

    c = model.config
    arch = by_name(c.architecture)
    assigner = WeightAssigner(model)
    parts: dict[tuple[int, int], dict[int, QuantPart]] = {}
    tables: dict[str, QuantPart] = {}
    for t in tqdm(reader.tensors, desc="reading GGUF blocks", unit="tensor", disable=not progress):
        name = hf_name(t.name, arch)
        if name is None:
            continue
        shape = [int(n) for n in reversed(t.shape.tolist())]
        quantized = t.tensor_type.name in QTYPES
        hit = _LAYER_NAME.fullmatch(name)
        if hit is not None and hit.group(2) in _PROJECTIONS:
            if not quantized:
                raise ValueError(
                    f"{t.name} is {t.tensor_type.name}: quantized weights need every projection in one "
                    f"of {sorted(QTYPES)}; load this model with --weights fp32"
                )
            data = np.asarray(t.data).reshape(shape[0], -1)
            if arch.gguf_qk_permuted and hit.group(2).split(".")[1] in ("q_proj", "k_proj"):
                heads = c.num_heads if "q_proj" in name else c.num_kv_heads
                data = unpermute_rows(data, heads)  # whole rows of blocks: the same permutation
            slot, order = _PROJECTIONS[hit.group(2)]
            parts.setdefault((int(hit.group(1)), slot), {})[order] = gguf_part(
                data, t.tensor_type.name, shape
            )
            assigner.missing.discard(name)
        elif name in ("model.embed_tokens.weight", "lm_head.weight") and quantized:
            tables[name] = gguf_part(t.data, t.tensor_type.name, shape)
            assigner.missing.discard(name)
        else:
            arr = dequantize(t.data, t.tensor_type).reshape(shape)
            assigner.assign(name, torch.from_numpy(np.array(arr, dtype=np.float32)))
    assigner.finish()
    ins = (c.hidden_size, c.q_size, c.hidden_size, c.intermediate_size)
    layers = []
    for i in range(c.num_layers):
        mats = [QuantMatrix([p for _, p in sorted(parts[(i, s)].items())], ins[s]) for s in range(4)]
        layers.append((mats[0], mats[1], mats[2], mats[3]))
    embed = tables.get("model.embed_tokens.weight")
    table = embed if embed is None else QuantMatrix([embed], c.hidden_size)
    head_part = tables.get("lm_head.weight", embed if c.tie_embeddings else None)
    head: QuantMatrix | torch.Tensor = model.lm_head
    if head_part is not None:
        head = QuantMatrix([head_part], c.hidden_size)
    model.use_quantized(layers, head, table)
