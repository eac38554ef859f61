"""The draft model as an ONNX graph: one `InferenceSession.run` evaluates n new rows (a prefill chunk,
a decode step, or one level of a token tree) against a KV cache the caller keeps.

The graph is written node by node with `onnx.helper` from the weights of the project's own
`LlamaModel` (a GGUF dequantized by `shared.model`), not traced: every op is a standard
ONNX op (opset 18), the row and past axes are symbolic by construction, and the weights stream
to one external-data file a tensor at a time, so exporting Qwen2.5-Coder-0.5B holds about one
copy of its floats. The arithmetic mirrors `LlamaModel.forward_packed`: RMSNorm, fused q|k|v
(+ biases for qwen2), rotate-half RoPE on absolute positions, grouped-query attention with an
additive mask, SwiGLU, final norm and LM head (fp32: a tied head gets its own transposed copy, a
plain MatMul). With int8, every projection and the head are MatMulNBits over 8-bit blocks written
as they are quantized (edge_client.onnx.quant), and the embedding is a Gather of those blocks (a
tied head shares them).

Inputs / outputs (P = past rows, n = new rows, k = rows whose logits are wanted):

    input_ids      int64   [n]
    position_ids   int64   [n]                     absolute positions (RoPE)
    attention_mask float32 [n, P + n]              additive: 0 = attend, very negative = not
    logit_rows     int64   [k]                     indices into the n rows
    past_key       float32 [P, layers, kv_heads, head_dim]   post-RoPE keys of the cached rows
    past_value     float32 [P, layers, kv_heads, head_dim]
    ->
    logits         float32 [k, vocab]
    present_key    float32 [n, layers, kv_heads, head_dim]   the new rows' keys (caller appends)
    present_value  float32 [n, layers, kv_heads, head_dim]

The cache is row-major ([rows, layers, ...]) so that the caller's buffer prefix `buf[:P]` is
contiguous and goes to onnxruntime without a copy; appending a run's rows is one slice write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Literal, overload

import numpy as np

if TYPE_CHECKING:
    from onnx import ModelProto
    from torch import Tensor

    from shared.model.llama import DecoderLayer, LlamaModel
    from shared.model.model_config import ModelConfig

OPSET = 18
INPUTS = ("input_ids", "position_ids", "attention_mask", "logit_rows", "past_key", "past_value")
OUTPUTS = ("logits", "present_key", "present_value")
_ALIGN = 64
MS_DOMAIN = "com.microsoft"  # MatMulNBits, onnxruntime's contrib op (int8 exports only)


@dataclass(frozen=True)
class Int8Weight:
    """The initializers of one int8 weight W [n, k] (edge_client.onnx.quant's block layout)."""

    q: str  # uint8 [n, blocks, block]
    scales: str  # float32 [n, blocks]
    n: int
    k: int
    block: int


class _Writer:
    """Builds the node list and streams initializers to one external-data file."""

    def __init__(self, data: BinaryIO, location: str) -> None:
        from onnx import helper

        self.h = helper
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self._data = data
        self._location = location
        self._n = 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    @overload
    def op(
        self, op_type: str, inputs: list[str], hint: str = "", n_out: Literal[1] = 1, **attrs: Any
    ) -> str: ...
    @overload
    def op(
        self, op_type: str, inputs: list[str], hint: str = "", *, n_out: Literal[2, 3], **attrs: Any
    ) -> list[str]: ...
    def op(
        self, op_type: str, inputs: list[str], hint: str = "", n_out: int = 1, **attrs: Any
    ) -> str | list[str]:
        """One node; its output name (n_out > 1: the list of names)."""
        outs = [self.name(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(self.h.make_node(op_type, inputs, outs, **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value: Any, hint: str = "c") -> str:
        """A small initializer stored inside the model file."""
        from onnx import numpy_helper

        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def _start(self) -> int:
        """Pad the data file to _ALIGN and return where the next tensor starts."""
        offset = self._data.tell()
        pad = -offset % _ALIGN
        if pad:
            self._data.write(b"\0" * pad)
        return offset + pad

    def _external(self, hint: str, data_type: int, dims: tuple[int, ...], offset: int, length: int) -> str:
        from onnx import TensorProto

        name = self.name(hint)
        t = TensorProto()
        t.name = name
        t.data_type = data_type
        t.dims.extend(dims)
        for key, value in (("location", self._location), ("offset", offset), ("length", length)):
            entry = t.external_data.add()
            entry.key, entry.value = key, str(value)
        t.data_location = TensorProto.EXTERNAL
        self.inits.append(t)
        return name

    def weight(self, array: np.ndarray, hint: str) -> str:
        """A large float32 initializer written to the external-data file now (not kept in memory)."""
        from onnx import TensorProto

        a = np.ascontiguousarray(array, dtype=np.float32)
        offset = self._start()
        self._data.write(a.data)  # no copy
        return self._external(hint, TensorProto.FLOAT, a.shape, offset, a.nbytes)

    def int8_weight(self, array: np.ndarray, hint: str) -> Int8Weight:
        """W [out, in] as MatMulNBits' 8-bit blocks (edge_client.onnx.quant), streamed a chunk of
        rows at a time: no float copy of W is made."""
        from onnx import TensorProto

        from edge_client.onnx.quant import block_size, quantize_rows

        rows, k = array.shape
        block = block_size(k)
        offset = self._start()
        scales = []
        for q, s in quantize_rows(array, block):
            self._data.write(q.data)
            scales.append(s)
        blocks = -(-k // block)
        q_name = self._external(
            f"{hint}_q", TensorProto.UINT8, (rows, blocks, block), offset, rows * blocks * block
        )
        return Int8Weight(q_name, self.weight(np.concatenate(scales), f"{hint}_scales"), rows, k, block)


def _np(p: Any) -> np.ndarray:
    """A torch parameter as a float32 numpy array (a view when it already is one)."""
    return np.asarray(p.detach().to("cpu").float().numpy())


def write_model(model: Any, out: Path, data_name: str = "model.onnx.data", *, int8: bool = False) -> None:
    """Write `model` (a shared.model LlamaModel with its projection weights in place) as
    `out` (the graph) and `out.parent / data_name` (its weights).

    int8: every projection, the LM head and the embedding as 8-bit blocks (edge_client.onnx.quant)
    run by MatMulNBits; norms, biases and rotary tables stay float32."""
    import onnx

    if getattr(model, "released", False):
        raise ValueError("the model's projection weights were released after packing; load it again")
    with open(out.parent / data_name, "wb") as data:
        w = _Writer(data, data_name)
        g = _DraftGraph(w, model.config, int8)  # the constants every layer shares
        x = g.embed(model)  # [n, hidden]
        for li, layer in enumerate(model.layers):
            x = g.layer(li, layer, x)
        g.head(model, x)
    onnx.save_model(_model_proto(w, model.config, int8), os.fspath(out))


class _DraftGraph:
    """The draft model's nodes, written on a _Writer in the order of a forward pass: the constants
    every layer shares (rotary tables included) when made, then `embed`, each `layer` and `head`.
    Each layer's keys and values (the present outputs) are collected in `keys` and `values`."""

    def __init__(self, w: _Writer, c: ModelConfig, int8: bool) -> None:
        self.w = w
        self.int8 = int8
        self.hd, self.heads = c.head_dim, c.num_heads
        self.keys: list[str] = []
        self.values: list[str] = []
        self.embed_q: Int8Weight | None = None  # int8: the embedding's blocks (a tied head shares them)
        hd, kvh, q_size, inter, i64 = c.head_dim, c.num_kv_heads, c.q_size, c.intermediate_size, np.int64
        self.eps = w.const(np.float32(c.rms_norm_eps), "eps")
        self.axis_last = w.const(np.array([-1], i64), "axes")
        self.cos, self.sin, self.axis1 = self._rotary_tables(c)
        self.halves = w.const(np.array([hd // 2, hd // 2], i64))
        self.q_shape = w.const(np.array([-1, kvh, c.group_size, hd], i64))  # [n, kv_heads, group, hd]
        self.kv_shape = w.const(np.array([-1, kvh, hd], i64))
        self.o_shape = w.const(np.array([-1, q_size], i64))
        self.qkv_split = w.const(np.array([q_size, c.kv_size, c.kv_size], i64))
        self.gu_split = w.const(np.array([inter, inter], i64))
        self.scale = w.const(np.float32(hd**-0.5), "scale")

    def _rotary_tables(self, c: ModelConfig) -> tuple[str, str, str]:
        """cos and sign-folded sin, [n, 1, head_dim], once per run; and the axis-1 constant."""
        from onnx import TensorProto

        from shared.model.llama import inverse_frequencies

        w = self.w
        sc = c.rope_scaling
        pos_scale = 1.0 / sc.factor if sc is not None and sc.kind == "linear" else 1.0
        pos = w.op("Cast", ["position_ids"], to=TensorProto.FLOAT)
        if pos_scale != 1.0:
            pos = w.op("Mul", [pos, w.const(np.float32(pos_scale))])
        inv = w.const(inverse_frequencies(c).numpy().astype(np.float32), "inv_freq")
        freqs = w.op("Mul", [w.op("Unsqueeze", [pos, w.const(np.array([1], np.int64))]), inv])  # [n, hd/2]
        cos, sin = w.op("Cos", [freqs]), w.op("Sin", [freqs])
        axis1 = w.const(np.array([1], np.int64))
        cos = w.op("Unsqueeze", [w.op("Concat", [cos, cos], axis=-1), axis1], "cos")
        sin = w.op("Unsqueeze", [w.op("Concat", [w.op("Neg", [sin]), sin], axis=-1), axis1], "sin")
        return cos, sin, axis1

    def rms_norm(self, x: str, weight: str) -> str:
        # the pattern onnxruntime fuses into SimplifiedLayerNormalization
        w = self.w
        sq = w.op("Pow", [x, w.const(np.float32(2.0), "two")])
        mean = w.op("ReduceMean", [sq, self.axis_last], keepdims=1)
        root = w.op("Sqrt", [w.op("Add", [mean, self.eps])])
        return w.op("Mul", [w.op("Div", [x, root]), weight])

    def rope(self, x: str) -> str:  # x: [n, heads, hd]
        w = self.w
        lo, hi = w.op("Split", [x, self.halves], n_out=2, axis=-1)
        swapped = w.op("Concat", [hi, lo], axis=-1)
        return w.op("Add", [w.op("Mul", [x, self.cos]), w.op("Mul", [swapped, self.sin])])

    def linear(self, x: str, weight: Tensor, hint: str, out: str | None = None) -> str:
        """x [n, k] @ W.T for a torch-layout weight W [n_out, k]."""
        w = self.w
        if self.int8:
            q = w.int8_weight(_np(weight), hint)
            return _matmul_nbits(w, x, q, out)
        y = out or w.name("matmul")
        w.nodes.append(w.h.make_node("MatMul", [x, w.weight(_np(weight).T, hint)], [y]))
        return y

    def embed(self, model: LlamaModel) -> str:
        """The rows of input_ids in the embedding: [n, hidden]."""
        w = self.w
        if self.int8:
            self.embed_q = w.int8_weight(_np(model.embed), "embed")
            return _gather_int8(w, self.embed_q, "input_ids")
        return w.op("Gather", [w.weight(_np(model.embed), "embed"), "input_ids"], axis=0)

    def layer(self, li: int, layer: DecoderLayer, x: str) -> str:
        """Decoder layer `li` on the residual stream x: attention, then the MLP; the new stream."""
        w = self.w
        xn = self.rms_norm(x, w.weight(_np(layer.attn_norm), "attn_norm"))
        attn = self.attention(li, layer, xn)
        x = w.op("Add", [x, self.linear(attn, layer.o, f"l{li}_o")])
        xn = self.rms_norm(x, w.weight(_np(layer.mlp_norm), "mlp_norm"))
        gu = self.linear(xn, layer.gate_up, f"l{li}_gate_up")  # [n, 2 inter]
        gate, up = w.op("Split", [gu, self.gu_split], n_out=2, axis=1)
        act = w.op("Mul", [w.op("Mul", [gate, w.op("Sigmoid", [gate])]), up])
        return w.op("Add", [x, self.linear(act, layer.down, f"l{li}_down")])

    def attention(self, li: int, layer: DecoderLayer, xn: str) -> str:
        """Grouped-query attention of the normed rows xn over the past and new rows, [n, q_size]
        (before the o projection); the new rows' keys and values join `keys` and `values`."""
        w, hd, i64 = self.w, self.hd, np.int64
        axis1 = self.axis1
        qkv = self.linear(xn, layer.qkv, f"l{li}_qkv")  # [n, q + 2 kv]
        if layer.qkv_bias is not None:
            qkv = w.op("Add", [qkv, w.weight(_np(layer.qkv_bias), f"l{li}_qkv_bias")])
        q, k, v = w.op("Split", [qkv, self.qkv_split], n_out=3, axis=1)
        q = self.rope(w.op("Reshape", [q, w.const(np.array([-1, self.heads, hd], i64))]))
        k = self.rope(w.op("Reshape", [k, self.kv_shape]))  # [n, kvh, hd]
        v = w.op("Reshape", [v, self.kv_shape])
        self.keys.append(w.op("Unsqueeze", [k, axis1]))  # [n, 1, kvh, hd]
        self.values.append(w.op("Unsqueeze", [v, axis1]))
        li_c = w.const(np.array(li, i64))
        k_all = w.op("Concat", [w.op("Gather", ["past_key", li_c], axis=1), k], axis=0)  # [P+n, kvh, hd]
        v_all = w.op("Concat", [w.op("Gather", ["past_value", li_c], axis=1), v], axis=0)
        k_t = w.op("Unsqueeze", [w.op("Transpose", [k_all], perm=[1, 2, 0]), axis1])  # [kvh, 1, hd, P+n]
        v_t = w.op("Unsqueeze", [w.op("Transpose", [v_all], perm=[1, 0, 2]), axis1])  # [kvh, 1, P+n, hd]
        qg = w.op("Transpose", [w.op("Reshape", [q, self.q_shape])], perm=[1, 2, 0, 3])  # [kvh, g, n, hd]
        scores = w.op("MatMul", [w.op("Mul", [qg, self.scale]), k_t])  # [kvh, g, n, P+n]
        probs = w.op("Softmax", [w.op("Add", [scores, "attention_mask"])], axis=-1)
        attn = w.op("Transpose", [w.op("MatMul", [probs, v_t])], perm=[2, 0, 1, 3])  # [n, kvh, g, hd]
        return w.op("Reshape", [attn, self.o_shape])

    def head(self, model: LlamaModel, x: str) -> None:
        """The logit rows' final norm and LM head (`logits`), and the present keys and values."""
        w = self.w
        rows = w.op("Gather", [x, "logit_rows"], axis=0)
        hidden = self.rms_norm(rows, w.weight(_np(model.norm), "norm"))
        if self.embed_q is not None and model.lm_head is model.embed:
            _matmul_nbits(w, hidden, self.embed_q, "logits")  # a tied head: the embedding's int8 blocks
        else:
            self.linear(hidden, model.lm_head, "lm_head", "logits")
        w.nodes.append(w.h.make_node("Concat", self.keys, ["present_key"], axis=1))
        w.nodes.append(w.h.make_node("Concat", self.values, ["present_value"], axis=1))


def _model_proto(w: _Writer, c: ModelConfig, int8: bool) -> ModelProto:
    """The model of the written nodes and initializers, with its inputs and outputs (INPUTS, OUTPUTS)."""
    from onnx import TensorProto
    from onnx import helper as h

    f32, i64t = TensorProto.FLOAT, TensorProto.INT64
    layers, kvh, hd = c.num_layers, c.num_kv_heads, c.head_dim
    kv_dims: list[str | int] = ["past", layers, kvh, hd]
    graph = h.make_graph(
        w.nodes,
        "treespec_draft",
        [
            h.make_tensor_value_info("input_ids", i64t, ["n"]),
            h.make_tensor_value_info("position_ids", i64t, ["n"]),
            h.make_tensor_value_info("attention_mask", f32, ["n", "total"]),
            h.make_tensor_value_info("logit_rows", i64t, ["k"]),
            h.make_tensor_value_info("past_key", f32, kv_dims),
            h.make_tensor_value_info("past_value", f32, kv_dims),
        ],
        [
            h.make_tensor_value_info("logits", f32, ["k", c.vocab_size]),
            h.make_tensor_value_info("present_key", f32, ["n", layers, kvh, hd]),
            h.make_tensor_value_info("present_value", f32, ["n", layers, kvh, hd]),
        ],
        w.inits,
    )
    opsets = [h.make_opsetid("", OPSET)] + ([h.make_opsetid(MS_DOMAIN, 1)] if int8 else [])
    proto = h.make_model(graph, opset_imports=opsets, producer_name="treespec")
    proto.ir_version = 8  # readable by onnxruntime releases from 1.14 on
    return proto


def _matmul_nbits(w: _Writer, x: str, q: Int8Weight, out: str | None) -> str:
    """x [n, k] @ dequant(q).T [k, n_out]; accuracy_level 4 = int8 activations (per block) and
    int8 dot products, onnxruntime's fast path on x86 (VNNI) and ARM."""
    y = out or w.name("matmul_nbits")
    w.nodes.append(
        w.h.make_node(
            "MatMulNBits",
            [x, q.q, q.scales],
            [y],
            domain=MS_DOMAIN,
            K=q.k,
            N=q.n,
            bits=8,
            block_size=q.block,
            accuracy_level=4,
        )
    )
    return y


def _gather_int8(w: _Writer, q: Int8Weight, ids: str) -> str:
    """Rows `ids` of an int8 weight [n, k], dequantized: [len(ids), k] float32."""
    from onnx import TensorProto

    from edge_client.onnx.quant import ZERO

    rows = w.op("Cast", [w.op("Gather", [q.q, ids], axis=0)], to=TensorProto.FLOAT)  # [m, blocks, block]
    scales = w.op("Unsqueeze", [w.op("Gather", [q.scales, ids], axis=0), w.const(np.array([-1], np.int64))])
    x = w.op("Mul", [w.op("Sub", [rows, w.const(np.float32(ZERO))]), scales])
    x = w.op("Reshape", [x, w.const(np.array([-1, -(-q.k // q.block) * q.block], np.int64))])
    if q.k % q.block:
        zero, k = w.const(np.array([0], np.int64)), w.const(np.array([q.k], np.int64))
        x = w.op("Slice", [x, zero, k, w.const(np.array([1], np.int64))])
    return x
