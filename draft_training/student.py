"""The draft as a trainable model: a differentiable causal forward over a `LlamaModel`'s own
parameters, LoRA adapters on its projections, and the distillation losses.

The serving forward (`LlamaModel.forward_packed`) runs under inference mode with packed weights and
C++ kernels; training needs autograd, so `Student.forward` is the same computation in plain torch
ops on the parameters as they are stored (fused q|k|v and gate|up, RoPE from the model's `Rotary`,
grouped-query attention through SDPA): tests/draft_training checks its logits against the serving
forward's. Which parameters train:

- full fine-tuning of chosen blocks (`blocks`): their norms and projections, optionally the final
  norm; the token table and head stay frozen (tied to each other in SmolLM2 and Qwen, and the
  largest matrices);
- LoRA (`lora_rank` > 0): W x + (alpha / r) B A x on the chosen projections (`lora_targets` of
  qkv, o, gate_up, down) of the chosen blocks; B starts at zero, so step 0 is the base model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shared.model.llama import DecoderLayer, LlamaModel

LORA_TARGETS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class TrainSpec:
    blocks: tuple[int, ...] | None = None  # None: every block
    lora_rank: int = 0  # 0: full fine-tuning of the blocks
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    final_norm: bool = True

    def check(self, num_layers: int) -> None:
        bad = [b for b in self.blocks or () if not 0 <= b < num_layers]
        if bad:
            raise ValueError(f"--blocks {bad} out of range: the draft has blocks 0..{num_layers - 1}")
        if self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be >= 0, got {self.lora_rank}")
        wrong = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if wrong or not self.lora_targets:
            raise ValueError(
                f"--lora-targets must be some of {','.join(LORA_TARGETS)}, got {wrong or 'none'}"
            )


class Student(nn.Module):
    """A draft model with the parameters a `TrainSpec` trains (everything else frozen)."""

    def __init__(self, model: LlamaModel, spec: TrainSpec, seed: int = 0) -> None:
        super().__init__()
        if model.weights != "fp32" or model.released:
            raise ValueError("the draft must be loaded with float weights (not quantized, not released)")
        spec.check(model.config.num_layers)
        self.model, self.spec = model, spec
        c = model.config
        self.blocks = tuple(range(c.num_layers)) if spec.blocks is None else tuple(sorted(set(spec.blocks)))
        model.requires_grad_(False)
        self.lora = nn.ParameterDict()
        gen = torch.Generator().manual_seed(seed)
        for b in self.blocks:
            layer = model.layers[b]
            assert isinstance(layer, DecoderLayer)
            if spec.lora_rank == 0:
                for p in layer.parameters():
                    p.requires_grad_(True)
                continue
            for t in spec.lora_targets:
                w: torch.Tensor = getattr(layer, t)
                out_f, in_f = w.shape
                a = torch.randn(spec.lora_rank, in_f, generator=gen) * in_f**-0.5
                self.lora[f"{b}_{t}_a"] = nn.Parameter(a.to(w.dtype))
                self.lora[f"{b}_{t}_b"] = nn.Parameter(torch.zeros(out_f, spec.lora_rank, dtype=w.dtype))
        if spec.final_norm and spec.lora_rank == 0:
            model.norm.requires_grad_(True)
        self._scale = spec.lora_alpha / spec.lora_rank if spec.lora_rank else 0.0

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of everything that trains, in a fixed order (checkpoints use the names)."""
        out = [(f"model.{n}", p) for n, p in self.model.named_parameters() if p.requires_grad]
        out += [(f"lora.{n}", p) for n, p in self.lora.items()]
        return out

    def _proj(
        self, x: torch.Tensor, b: int, name: str, w: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        y = F.linear(x, w, bias)
        key = f"{b}_{name}_a"
        if key in self.lora:
            y = y + self._scale * F.linear(F.linear(x, self.lora[key]), self.lora[f"{b}_{name}_b"])
        return y

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """tokens [T] int64 (one sequence from position 0) -> logits [T - start, vocab] float32 of
        positions start.. (the head, the largest product, only where a loss reads it)."""
        m, c = self.model, self.model.config
        t, hd = tokens.shape[0], c.head_dim
        eps, shape = c.rms_norm_eps, (c.hidden_size,)
        cos, sin = m.rotary.tables(torch.arange(t), m.dtype)
        h = F.embedding(tokens, m.embed)
        nq, nkv = c.num_heads, c.num_kv_heads
        for b, layer in enumerate(m.layers):
            assert isinstance(layer, DecoderLayer)
            x = F.rms_norm(h, shape, layer.attn_norm, eps)
            qkv = self._proj(x, b, "qkv", layer.qkv, layer.qkv_bias)
            qk = m.rotary.apply(qkv[:, : (nq + nkv) * hd].view(t, nq + nkv, hd), cos, sin)
            q = qk[:, :nq].transpose(0, 1)  # [heads, T, hd]
            k = qk[:, nq:].transpose(0, 1)  # [kv heads, T, hd]
            v = qkv[:, (nq + nkv) * hd :].view(t, nkv, hd).transpose(0, 1)
            o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
            h = h + self._proj(o.transpose(0, 1).reshape(t, nq * hd), b, "o", layer.o, None)
            x = F.rms_norm(h, shape, layer.mlp_norm, eps)
            gu = self._proj(x, b, "gate_up", layer.gate_up, None)
            inter = c.intermediate_size
            h = h + self._proj(F.silu(gu[:, :inter]) * gu[:, inter:], b, "down", layer.down, None)
        return F.linear(F.rms_norm(h[start:], shape, m.norm, eps), m.lm_head).float()

    @torch.no_grad()
    def merge_lora(self) -> None:
        """Fold the adapters into the base projections (W += scale B A) and drop them."""
        for b in self.blocks:
            layer = self.model.layers[b]
            for t in LORA_TARGETS:
                key = f"{b}_{t}_a"
                if key in self.lora:
                    w: torch.Tensor = getattr(layer, t)
                    w += self._scale * (self.lora[f"{b}_{t}_b"] @ self.lora[key])
        self.lora = nn.ParameterDict()


def distill_loss(
    logits: torch.Tensor,
    top_ids: torch.Tensor,
    top_probs: torch.Tensor,
    rest: torch.Tensor,
    target: torch.Tensor,
    kind: str = "kl",
    ce_weight: float = 0.1,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over positions of the divergence from the teacher's stored distribution (its top-k
    probabilities plus the rest of the mass as one outcome) and `ce_weight` x cross-entropy on
    the teacher's token; with `weights` [n] (boosting), their weighted sum over the positions
    divided by n, so that a position of weight 0 teaches nothing and a batch's scale is kept.

    logits [n, V] (the student's, at the positions that predict each stored token); top_ids
    [n, k] int64; top_probs [n, k]; rest [n]; target [n] int64.
    kind "kl": forward KL(p || q) = sum p (log p - log q); "tvd": total variation, 1/2 sum |p - q|.
    """
    logq = torch.log_softmax(logits, dim=-1)
    lq_top = logq.gather(1, top_ids)  # [n, k]
    q_top = lq_top.exp()
    q_rest = (1.0 - q_top.sum(-1)).clamp_min(1e-12)
    p_rest = rest.clamp_min(0.0)
    if kind == "kl":
        p = top_probs.clamp_min(1e-12)
        div = (top_probs * (p.log() - lq_top)).sum(-1) + p_rest * (
            p_rest.clamp_min(1e-12).log() - q_rest.log()
        )
    elif kind == "tvd":
        div = 0.5 * ((top_probs - q_top).abs().sum(-1) + (p_rest - q_rest).abs())
    else:
        raise ValueError(f"loss must be 'kl' or 'tvd', got {kind!r}")
    ce = -logq.gather(1, target[:, None])[:, 0]
    per = div + ce_weight * ce
    return per.mean() if weights is None else (weights * per).sum() / per.numel()


def simulated_tau(agree: Sequence[Sequence[bool]], depth: int = 8) -> float:
    """1 + sum_k P(the first k drafted tokens all match) over k = 1..depth, estimated from every
    position of every sequence: the expected tokens of a greedy chain round of `depth` draft tokens
    (accepted ones plus the bonus). A run cut by the end of its record counts as it is, so short
    records underestimate a little."""
    runs = []
    for seq in agree:
        run = 0
        for ok in reversed(seq):  # the run of matches starting at each position
            run = run + 1 if ok else 0
            runs.append(run)
    if not runs:
        return 1.0
    n = len(runs)
    return 1.0 + sum(sum(r >= k for r in runs) / n for k in range(1, depth + 1))
