"""Tree-based parallel decoding, node by node against incremental decoding on each root-to-node path.

A round's rows are the committed-but-uncached tail (ending with row 0) and the tree's nodes; every
node's logits must equal those of decoding its path one token at a time (max |Δ| ≤ 1e-4 in fp32),
for plain and conditional trees, and after `commit` the cache must equal that of straight
decoding of the accepted tokens. `tiny` runs by default; `smollm2-135m` with SLOW=1.
"""

from __future__ import annotations

import random

import pytest
import torch

from shared.model import (
    LlamaModel,
    PagedKVCache,
    build_model,
    decode_step,
    make_tiny_config,
    prefill,
    prefill_chunk,
    round_keep,
    tree_round,
)
from shared.model.inputs import SeqInput
from shared.model.kv_cache import KVCacheFull
from shared.model.llama import onednn_available
from tests.cloud_verifier.helpers import incremental_logits, max_diff, random_tree, straight_cache

TOL = 1e-4
GEMMS = ["torch", *(["onednn"] if onednn_available() else [])]


@pytest.fixture(scope="module")
def tiny() -> LlamaModel:
    return build_model(make_tiny_config(), seed=0, dtype="float32", device="cpu")


def check_round(
    model: LlamaModel,
    rng: random.Random,
    prompt_len: int,
    nodes: int,
    tail: int,
    cond: int,
    tol: float = TOL,
    exact: bool = False,
) -> float:
    """One random round: compare every row's logits with the oracle, commit a random path and
    compare the cache with a straight prefill. Returns the max |Δlogit|. With `exact` every
    logit must be bit-identical (the batch-invariant CPU attention with oneDNN projections)."""
    if exact:
        tol = 0.0
    vocab = model.config.vocab_size
    committed = [rng.randrange(vocab) for _ in range(prompt_len)]
    base = prompt_len - cond
    tree = random_tree(rng, nodes, vocab, base, committed[base:])
    assert tree.committed_len == prompt_len

    kv = model.new_kv_cache(64, 16)
    kv.add(7)
    if prompt_len > tail:
        prefill(model, kv, 7, committed[: prompt_len - tail])
    x = tree_round(7, tree, committed[prompt_len - tail :])
    (logits,) = model.forward_packed([x], kv)
    assert logits.shape == (tail + nodes, vocab) and logits.dtype == torch.float32

    ref_committed, ref_nodes = incremental_logits(model, committed, tree)
    worst = max(
        max_diff(logits[:tail], ref_committed[prompt_len - tail :]), max_diff(logits[tail:], ref_nodes)
    )
    assert worst <= tol, f"max |Δlogit| {worst:.3g}"

    accepted = tree.path(rng.randrange(nodes)) if rng.random() < 0.9 else []
    kv.commit_rows(7, round_keep(tail, accepted))
    path_tokens = [int(tree.tokens[i]) for i in accepted]
    want = straight_cache(model, committed + path_tokens)
    k, v = kv.sequence_kv(7)
    k_ref, v_ref = want.sequence_kv(0)
    assert k.shape == k_ref.shape
    # K/V entries reach tens in real models: compare relative to the largest one
    for got, ref in ((k, k_ref), (v, v_ref)):
        assert max_diff(got, ref) <= tol * max(1.0, float(ref.abs().max()))
    assert kv.blocks_in_use == -(-(prompt_len + len(path_tokens)) // 16)
    # and the next step reads the committed cache exactly as it reads the straight one
    nxt = rng.randrange(vocab)
    length = prompt_len + len(path_tokens)
    (after,) = model.forward_packed([decode_step(7, nxt, length)], kv)
    (after_ref,) = model.forward_packed([decode_step(0, nxt, length)], want)
    worst = max(worst, max_diff(after, after_ref))
    assert worst <= tol, f"max |Δlogit| after commit {worst:.3g}"
    return worst


def bit_exact(model: LlamaModel, gemm: str) -> bool:
    """Whether a tree row must equal its path decoded alone bit for bit: the batch-invariant CPU
    attention (or float64 attention) with oneDNN's row-invariant projections."""
    invariant_attention = model.attention_kernel == "cpu-invariant" or model.attention_mode == "float64"
    return gemm == "onednn" and invariant_attention


@pytest.mark.parametrize("mode", ["model", "float64", "sdpa"])
@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("seed", range(4))
def test_tiny_tree_matches_incremental(tiny: LlamaModel, gemm: str, mode: str, seed: int) -> None:
    rng = random.Random(seed)
    tiny.set_gemm(gemm)
    tiny.set_attention(mode)
    try:
        check_round(
            tiny,
            rng,
            prompt_len=rng.randint(2, 40),
            nodes=rng.randint(1, 24),
            tail=1 if seed % 2 else rng.randint(1, 2),
            cond=0 if seed < 2 else rng.randint(1, 2),
            exact=bit_exact(tiny, gemm),
        )
    finally:
        tiny.set_gemm("auto")
        tiny.set_attention("model")


def test_tiny_tree_with_long_prefix_and_full_tail(tiny: LlamaModel) -> None:
    """Prefix across many blocks; the whole committed sequence as the uncached tail."""
    rng = random.Random(99)
    check_round(tiny, rng, prompt_len=70, nodes=20, tail=3, cond=3)
    check_round(tiny, rng, prompt_len=9, nodes=5, tail=9, cond=0)


def test_packed_sequences_equal_separate_forwards(tiny: LlamaModel) -> None:
    """A tree round, a prefill chunk and a decode step packed in one forward give the logits and
    caches they give alone."""
    rng = random.Random(3)
    vocab = tiny.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in ((1, 23), (2, 5), (3, 40))}
    tree = random_tree(rng, 12, vocab, 23, [])
    chunk = [rng.randrange(vocab) for _ in range(17)]

    def setup() -> tuple[PagedKVCache, list[SeqInput]]:
        kv = tiny.new_kv_cache(64, 16)
        for s, p in prompts.items():
            kv.add(s)
            prefill(tiny, kv, s, p[:-1] if s == 1 else p)
        work = [
            tree_round(1, tree, prompts[1][-1:]),
            prefill_chunk(2, chunk, len(prompts[2]), logits_last=False),
            decode_step(3, 11, len(prompts[3])),
        ]
        work[1].logit_rows = torch.tensor([3, 16])
        return kv, work

    kv_packed, work = setup()
    packed = tiny.forward_packed(work, kv_packed)
    kv_alone, work = setup()
    alone = [tiny.forward_packed([w], kv_alone)[0] for w in work]
    for a, b in zip(packed, alone, strict=True):
        assert a.shape == b.shape and max_diff(a, b) <= TOL
    for kv in (kv_packed, kv_alone):
        kv.commit(1, tree.path(7))
        kv.commit_rows(2, range(17))
        kv.commit_rows(3, [0])
    for s in prompts:
        for a, b in zip(kv_packed.sequence_kv(s), kv_alone.sequence_kv(s), strict=True):
            assert max_diff(a, b) <= TOL


def test_forward_refuses_when_the_pool_is_full(tiny: LlamaModel) -> None:
    kv = tiny.new_kv_cache(3, 16)
    kv.add(0)
    prefill(tiny, kv, 0, list(range(40)))
    kv.add(1)
    before = (kv.k.clone(), kv.v.clone(), kv.block_table(0), kv.num_free_blocks)
    with pytest.raises(KVCacheFull, match="needed"):
        tiny.forward_packed([decode_step(0, 5, 40), prefill_chunk(1, list(range(20)), 0)], kv)
    assert torch.equal(kv.k, before[0]) and torch.equal(kv.v, before[1])
    assert kv.block_table(0) == before[2] and kv.num_free_blocks == before[3]
    assert kv.cached_len(0) == 40 and kv.block_table(1) == []


def test_logits_only_for_requested_rows(tiny: LlamaModel) -> None:
    kv = tiny.new_kv_cache(8, 16)
    kv.add(0)
    x = prefill_chunk(0, list(range(10)), 0, logits_last=False)
    x.logit_rows = torch.tensor([], dtype=torch.int64)
    (out,) = tiny.forward_packed([x], kv)
    assert out.shape == (0, tiny.config.vocab_size)
    x.logit_rows = torch.tensor([9, 2])
    (out,) = tiny.forward_packed([x], kv)
    (full,) = tiny.forward_packed([prefill_chunk(0, list(range(10)), 0, logits_last=False)], kv)
    assert out.shape == (2, tiny.config.vocab_size) and full.shape[0] == 0


@pytest.fixture(scope="module")
def smollm2() -> LlamaModel:
    from shared.model import load_target

    return load_target("smollm2-135m", progress=False).model


# SDPA sums a tree row's terms in another order than the token decoded alone; through SmolLM2's
# 30 layers that leaves up to a few 1e-4 of logit noise. The default ("model": the batch-invariant
# CPU kernel) and float64 attention remove it: with oneDNN's row-invariant projections the rows
# are then bit-identical, which `exact` asserts.
SMOLLM2_TOL = {"float64": TOL, "model": TOL, "sdpa": 1e-3}


# the default path on 30 random rounds, the other two on 4
SMOLLM2_CASES = [(m, s) for m in ("model", "float64", "sdpa") for s in range(4)] + [
    ("model", s) for s in range(4, 30)
]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "seed"), SMOLLM2_CASES)
def test_smollm2_tree_matches_incremental(smollm2: LlamaModel, seed: int, mode: str) -> None:
    rng = random.Random(100 + seed)
    smollm2.set_attention(mode)
    try:
        worst = check_round(
            smollm2,
            rng,
            prompt_len=rng.randint(8, 40),
            nodes=rng.randint(8, 32),
            tail=rng.randint(1, 3),
            cond=rng.randint(0, 2),
            tol=SMOLLM2_TOL[mode],
            exact=bit_exact(smollm2, smollm2.prepare().gemm.kind),
        )
    finally:
        smollm2.set_attention("model")
    print(f"smollm2-135m seed {seed} attention {mode}: max |Δlogit| = {worst:.3g}")


def test_malformed_inputs_are_refused_before_reserving(tiny: LlamaModel) -> None:
    kv = tiny.new_kv_cache(4, 16)
    kv.add(0)
    good = prefill_chunk(0, [1, 2, 3], 0)
    bad = [
        prefill_chunk(0, [1, tiny.config.vocab_size], 0),
        tree_round(0, random_tree(random.Random(0), 3, 100, 1, []), [5]),
    ]
    bad[1].tree_mask = torch.zeros(4, 4, dtype=torch.bool)  # no row may attend to itself
    for x in bad:
        with pytest.raises(ValueError):
            tiny.forward_packed([good, x] if x.seq_id != 0 else [x], kv)
        assert kv.blocks_in_use == 0 and kv.scratch_len(0) == 0


def test_fragmented_block_tables_read_the_same(tiny: LlamaModel) -> None:
    """Sequences grown in turns end up with scattered blocks (gathered, not viewed): same logits."""
    rng = random.Random(5)
    vocab = tiny.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (90, 12, 12, 30)]
    kv = tiny.new_kv_cache(52, 4)
    for s in range(4):
        kv.add(s)
    for a in range(0, 90, 3):  # the sequences grow by 3 tokens in turn
        for s, p in enumerate(prompts):
            if a < len(p):
                prefill(tiny, kv, s, p[a : a + 3])
    trees = [random_tree(rng, 10, vocab, len(p) + 1, []) for p in prompts]  # tail: one token, 7
    packed = tiny.forward_packed([tree_round(s, t, [7]) for s, t in enumerate(trees)], kv)
    tables = [kv.block_table(s) for s in range(4)]
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables)
    for p, tree, got in zip(prompts, trees, packed, strict=True):
        alone = straight_cache(tiny, p)
        (want,) = tiny.forward_packed([tree_round(0, tree, [7])], alone)
        assert max_diff(got, want) <= TOL


@pytest.fixture(scope="module")
def qwen15() -> LlamaModel:
    from shared.model import load_target

    model = load_target("qwen2.5-coder-1.5b", progress=False).model
    model.prepare(release=True)  # one copy of the 7.1 GB of weights
    return model


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_qwen15_tree_matches_incremental(qwen15: LlamaModel, seed: int) -> None:
    """The 1.5B target (qwen2: q/k/v biases, GQA 12:2, head_dim 128, untied head): every tree row
    bit-identical to its path decoded one token at a time, the prompt included (the strict oracle)."""
    rng = random.Random(500 + seed)
    worst = check_round(
        qwen15,
        rng,
        prompt_len=rng.randint(6, 24),
        nodes=rng.randint(6, 16),
        tail=rng.randint(1, 3),
        cond=rng.randint(0, 2),
        exact=bit_exact(qwen15, qwen15.prepare().gemm.kind),
    )
    print(f"qwen2.5-coder-1.5b seed {seed}: max |Δlogit| = {worst:.3g}")
