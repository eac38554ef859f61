"""The target with quantized weights (shared/model/quantized.py, `--weights quantized`): every
tree row bit-identical to its path decoded one token at a time, greedy tree rounds through the step
runner giving the same tokens as this target alone, the GGUF loader keeping the blocks (q/k rows of
a `llama` file un-permuted like the float loader's) and refusing what it cannot run."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from cloud_verifier.step import EngineConfig, RoundResult, SeqState, StepRunner
from shared.messages import Mode, Prompt
from shared.model import LlamaModel, build_model, load_target, make_tiny_config
from shared.model.generate import greedy_generate
from shared.model.gguf_loader import config_from_gguf, load_gguf_quantized, load_gguf_weights, open_gguf
from shared.model.llama import DecoderLayer
from shared.model.quantized import QuantMatrix, QuantPart, quantize_part
from shared.model.target import Target
from tests.cloud_verifier.service import prompt_tokens, scripted_tree, tiny
from tests.cloud_verifier.test_tree_forward import check_round
from tests.treespec_kernels.test_quant_matmul import random_blocks
from treespec_kernels import quant_matmul as qm

pytestmark = pytest.mark.skipif(qm.load() is None, reason=f"quant_matmul kernel not built: {qm.error()}")

SMALL = (1e-5, 2e-4)  # block scales of the random K-type weights: activations stay moderate


def _random(name: str, out: int, in_features: int, seed: int) -> QuantPart:
    q = qm.qtype(name)
    return QuantPart(q, random_blocks(q, out, in_features, seed, SMALL))


def quantized_tiny(seed: int = 0) -> LlamaModel:
    """A small model whose projections mix every block type as the 1.5B does (q, k Q4_K with v
    Q6_K in one fused q|k|v), some quantized from its float weights (Q8_0, Q5_0, Q4_1: SmolLM2's
    type), the K types random; a Q8_0 token table, tied to the head."""
    config = make_tiny_config(hidden_size=256, intermediate_size=512, head_dim=32)
    model = build_model(config, seed, "float32", "cpu")
    c = model.config
    layers = []
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        s = 10 * i + seed
        qkv = QuantMatrix(
            [
                _random("Q4_K", c.q_size, c.hidden_size, s),
                quantize_part(layer.qkv[c.q_size : c.q_size + c.kv_size], "Q8_0"),
                _random("Q6_K", c.kv_size, c.hidden_size, s + 1),
            ],
            c.hidden_size,
        )
        half = c.hidden_size // 2
        o_parts = [quantize_part(layer.o[:half], "Q5_0"), quantize_part(layer.o[half:], "Q4_1")]
        o = QuantMatrix(o_parts, c.q_size)
        inter = c.intermediate_size
        gate_up = QuantMatrix(
            [_random("Q4_K", inter, c.hidden_size, s + 2), quantize_part(layer.gate_up[inter:], "Q8_0")],
            c.hidden_size,
        )
        down = QuantMatrix([_random("Q6_K", c.hidden_size, inter, s + 3)], inter)
        layers.append((qkv, o, gate_up, down))
    table = QuantMatrix([quantize_part(model.embed, "Q8_0")], c.hidden_size)
    model.use_quantized(layers, table, table)
    return model


@pytest.fixture(scope="module")
def qtiny() -> LlamaModel:
    return quantized_tiny()


@pytest.mark.parametrize("seed", range(6))
def test_every_tree_row_equals_its_path_decoded_alone_bit_for_bit(qtiny: LlamaModel, seed: int) -> None:
    rng = random.Random(700 + seed)
    assert qtiny.weights == "quantized"
    check_round(
        qtiny,
        rng,
        prompt_len=rng.randint(2, 40),
        nodes=rng.randint(1, 24),
        tail=rng.randint(1, 3),
        cond=rng.randint(0, 2),
        exact=True,
    )


def test_the_float_projections_are_gone_and_the_weights_cannot_be_repacked(qtiny: LlamaModel) -> None:
    for layer in qtiny.layers:
        assert isinstance(layer, DecoderLayer)
        assert all(p.numel() == 0 for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert qtiny.embed.numel() == 0 and qtiny.released
    # what the KV pool's share is sized from: the blocks and the float norms, not 4 bytes a weight
    prep = qtiny.prepare()
    # (a matrix the kernel repacked at load counts its packed copy, what the forwards read)
    blocks = sum(m.resident_nbytes for ws in prep.layers for m in ws if isinstance(m, QuantMatrix))
    table = prep.lm_head.resident_nbytes if isinstance(prep.lm_head, QuantMatrix) else 0
    lookup = qtiny._quant_embed
    if lookup is not None and lookup is not prep.lm_head:  # a tied table whose head was repacked
        table += lookup.nbytes
    floats = sum(p.numel() * 4 for p in qtiny.parameters())
    assert qtiny.weight_bytes() == blocks + table + floats < qtiny.config.num_parameters() * 4 // 3
    with pytest.raises(RuntimeError, match="released"):
        qtiny.set_gemm("torch")


def _target(model: LlamaModel) -> Target:
    t = tiny()  # the same vocabulary and tokenizer
    fp, eos = t.vocab_fingerprint, t.eos_ids
    return Target(model, model.config, t.tokenizer, "quantized-tiny", fp, eos, t.device, t.dtype)


def tree_generation(target: Target, prompt: list[int], ref: list[int], rng: random.Random) -> list[int]:
    """Greedy rounds through the step runner, each a scripted tree that follows `ref` for a while
    and then errs (accepts, rejections and bonus tokens all happen); the tokens it commits."""
    runner = StepRunner(target, target.new_kv_cache(256, 16), EngineConfig(gather_ms=0))
    got: list[int] = []
    seqs: list[SeqState] = []

    def on_result(res: RoundResult) -> None:
        got.extend(res.tokens)
        if not res.done:
            s = seqs[0]
            runner.submit(s, res.round + 1, scripted_tree(rng, list(s.committed), prompt + ref))

    seqs.append(runner.open(on_result))
    first = scripted_tree(rng, prompt, prompt + ref)
    msg = Prompt(np.asarray(prompt, dtype=np.int32), Mode.GREEDY, max_new_tokens=len(ref), tree=first)
    runner.start(seqs[0], msg, np.asarray(prompt, dtype=np.int32))
    for _ in range(4 * len(ref)):
        if not runner.step():
            break
    return got


def test_greedy_tree_rounds_give_the_tokens_of_this_target_alone(qtiny: LlamaModel) -> None:
    target = _target(qtiny)
    rng = random.Random(3)
    for k in range(3):
        prompt = prompt_tokens(90 + k, 5 + 3 * k)
        ref = greedy_generate(qtiny, qtiny.new_kv_cache(256, 16), prompt, 12, eos_ids=target.eos_ids)
        assert tree_generation(target, prompt, ref, rng) == ref


# ---------------------------------------------------------------------------------------------------
# The GGUF loader


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of a `llama` q/k projection (what gguf_loader.unpermute_rows undoes)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, model: LlamaModel) -> None:
    """`model` as a `llama` GGUF: Q8_0 projections and token table (q/k rows permuted as llama.cpp
    writes them), F32 norms, no tokenizer (the loader's weights only)."""
    c = model.config
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_theta)
    w.add_context_length(c.max_position)
    w.add_vocab_size(c.vocab_size)

    def q8(name: str, t: torch.Tensor, heads: int = 0) -> None:
        arr = t.detach().numpy().astype(np.float32)
        if heads:
            arr = _permute(arr, heads)
        w.add_tensor(name, quantize(arr, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)

    q8("token_embd.weight", model.embed)
    w.add_tensor("output_norm.weight", model.norm.detach().numpy())
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", layer.attn_norm.detach().numpy())
        w.add_tensor(p + "ffn_norm.weight", layer.mlp_norm.detach().numpy())
        qkv, gu = layer.qkv, layer.gate_up
        q8(p + "attn_q.weight", qkv[:q], c.num_heads)
        q8(p + "attn_k.weight", qkv[q : q + kv], c.num_kv_heads)
        q8(p + "attn_v.weight", qkv[q + kv :])
        q8(p + "attn_output.weight", layer.o)
        q8(p + "ffn_gate.weight", gu[:inter])
        q8(p + "ffn_up.weight", gu[inter:])
        q8(p + "ffn_down.weight", layer.down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _logits(model: LlamaModel, tokens: list[int]) -> torch.Tensor:
    from shared.model import prefill

    kv = model.new_kv_cache(64, 16)
    kv.add(0)
    return prefill(model, kv, 0, tokens)


def test_the_loader_keeps_the_blocks_and_agrees_with_the_float_load(tmp_path: Path) -> None:
    source = build_model(make_tiny_config(), 1, "float32", "cpu")
    path = tmp_path / "tiny-llama.gguf"
    write_llama_gguf(path, source)
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    quant = build_model(config, None, "float32", "cpu")
    load_gguf_quantized(reader, quant, progress=False)
    floats = build_model(config, None, "float32", "cpu")
    load_gguf_weights(reader, floats, progress=False)
    assert quant.weights == "quantized" and floats.weights == "fp32"
    tokens = torch.tensor([5, 17, 300, 4000, 49151])
    assert torch.equal(quant.embed_tokens(tokens), floats.embed[tokens])  # the lookup is exact
    prompt = prompt_tokens(5, 10)
    got, want = _logits(quant, prompt), _logits(floats, prompt)
    # int8 activations: close to the float32 product of the same blocks, not equal (a q/k row
    # order wrong by the permutation would be far off)
    rel = float((got - want).norm() / want.norm())
    assert 0 < rel < 0.05, rel
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert agree >= 0.8, agree


def test_what_cannot_run_quantized_is_refused_with_the_reason(qtiny: LlamaModel, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weights must be one of"):
        load_target("tiny", weights="q4")
    with pytest.raises(ValueError, match="GGUF"):
        load_target("tiny", weights="quantized")
    c = qtiny.config
    model = build_model(c, 0, "float32", "cpu")
    wrong = QuantMatrix([_random("Q8_0", c.hidden_size, c.hidden_size, 0)], c.hidden_size)
    with pytest.raises(ValueError, match="layers of quantized weights"):
        model.use_quantized([], wrong)
    with pytest.raises(ValueError, match="projection 0"):
        model.use_quantized([(wrong, wrong, wrong, wrong)] * c.num_layers, wrong)
    with pytest.raises(ValueError, match=r"must be \[rows, 34\] uint8"):
        QuantMatrix([QuantPart(qm.qtype("Q8_0"), torch.zeros(2, 10, dtype=torch.uint8))], 32)


def test_the_service_refuses_quantized_weights_for_a_model_without_blocks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from cloud_verifier.cli import main

    assert main(["serve", "--model", "tiny", "--weights", "quantized", "--tensor-parallel", "2"]) == 2
    assert "the tiny model has none (use --weights fp32 or auto)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smollm2q() -> LlamaModel:
    return load_target("smollm2-135m", progress=False, weights="quantized").model


@pytest.mark.parametrize("seed", range(3))
def test_smollm2_quantized_tree_rows_equal_one_token_decoding(smollm2q: LlamaModel, seed: int) -> None:
    """SmolLM2's GGUF: Q4_1 projections and a Q8_0 token table tied to the head."""
    mats = [m for ws in smollm2q.prepare().layers for m in ws if isinstance(m, QuantMatrix)]
    assert {t for m in mats for t in m.types} == {"Q4_1"}
    head = smollm2q.prepare().lm_head
    assert isinstance(head, QuantMatrix) and head.types == ("Q8_0",)
    rng = random.Random(800 + seed)
    check_round(
        smollm2q,
        rng,
        prompt_len=rng.randint(6, 40),
        nodes=rng.randint(6, 24),
        tail=rng.randint(1, 3),
        cond=rng.randint(0, 2),
        exact=True,
    )


@pytest.fixture(scope="module")
def qwen05q() -> LlamaModel:
    return load_target("qwen2.5-coder-0.5b", progress=False, weights="quantized").model


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_qwen05_quantized_tree_rows_equal_one_token_decoding(qwen05q: LlamaModel, seed: int) -> None:
    """The 0.5B's GGUF has all four block types (Q5_0, Q8_0, Q4_K, Q6_K) and a Q5_0 token table."""
    mats = [m for ws in qwen05q.prepare().layers for m in ws if isinstance(m, QuantMatrix)]
    assert {t for m in mats for t in m.types} == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    rng = random.Random(900 + seed)
    check_round(
        qwen05q,
        rng,
        prompt_len=rng.randint(6, 24),
        nodes=rng.randint(6, 16),
        tail=rng.randint(1, 3),
        cond=rng.randint(0, 2),
        exact=True,
    )


@pytest.fixture(scope="module")
def qwen15q() -> LlamaModel:
    return load_target("qwen2.5-coder-1.5b", progress=False, weights="quantized").model


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3))
def test_qwen15_quantized_tree_rows_equal_one_token_decoding(qwen15q: LlamaModel, seed: int) -> None:
    """The 1.5B target as it runs with --weights quantized (Q4_K and Q6_K, a Q4_K token table and
    a Q6_K head): every tree row bit-identical to its path decoded one token at a time."""
    rng = random.Random(950 + seed)
    check_round(
        qwen15q,
        rng,
        prompt_len=rng.randint(6, 24),
        nodes=rng.randint(6, 16),
        tail=rng.randint(1, 3),
        cond=rng.randint(0, 2),
        exact=True,
    )


def test_the_cost_curve_cache_knows_whether_the_weights_were_repacked(
    qtiny: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A curve measured with packing off (or on) is not reused for the other: the few-row forwards
    cost several times more without it."""
    from cloud_verifier.cost import cost_cache_key

    target = _target(qtiny)
    on = cost_cache_key(target, 1, (1, 2), 8)
    monkeypatch.setenv("TREESPEC_PACKED_ROWS", "0")
    assert cost_cache_key(target, 1, (1, 2), 8) != on
