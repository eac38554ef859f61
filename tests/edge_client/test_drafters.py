"""The Drafter contract, checked on every backend (see edge_client/drafters/base.py).

Backends: `fake` (exact, model-free: the bookkeeping alone), `llama_cpp` on the packaged SmolLM2
GGUF, `torch` on the `tiny` random-weight target (skipped until the cloud runtime is present),
`onnx` on the ONNX export of `tiny` and `onnx_int8` on its int8 export (skipped without onnxruntime).

"Same distribution" is exact for fake, |Δlogit| <= 1e-4 for torch (fp32: a batched tree forward vs
a fresh forward of the path) and onnx, fp32 or int8 (cached tree rows vs a fresh causal run: int8
activations are quantized per row, so batching does not change them), and for llama.cpp
total variation <= LLAMA_SELF_TV. llama.cpp quantizes activations to 8 bits in every matmul, so
any change of evaluation order (a node evaluated in a tree batch vs in a fresh prefill, cells freed
by dropped branches being reused) flips some rounding steps: measured on 90 random nodes, TV mean
0.035, max 0.072, max |Δlogit| 1.06, bit-identical only while no freed cell has been reused. The
bound doubles the measured maximum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from edge_client.drafters import (
    ContextFullError,
    Drafter,
    DrafterError,
    WorkspaceFullError,
    available_backends,
    backend_class,
    create_drafter,
)
from tests.edge_client.fake_drafter import FakeDrafter
from tests.shared.gguf_files import MALFORMED, write_tiny_gguf

LLAMA_SELF_TV = 0.15
TORCH_ATOL = 1e-4
PROMPT = "Once upon a time, in a small village by the sea, there lived"

Factory = Callable[..., Drafter]


def _torch_available() -> bool:
    try:
        from edge_client.drafters import torch_drafter  # noqa: F401
        from shared.model import load_target  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(params=["fake", "llama_cpp", "torch", "onnx", "onnx_int8"])
def backend(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name in ("torch", "onnx", "onnx_int8") and not _torch_available():
        pytest.skip("shared.model (the torch runtime) is not available")
    if name in ("onnx", "onnx_int8"):
        pytest.importorskip("onnxruntime")
    return name


@pytest.fixture
def make(backend: str, request: pytest.FixtureRequest) -> Iterator[Factory]:
    made: list[Drafter] = []

    def factory(**limits: int) -> Drafter:
        opts = {"max_context": 256, "max_nodes": 32, "max_leaves": 8, **limits}
        d: Drafter
        if backend == "fake":
            d = FakeDrafter(vocab_size=64, **opts)
        elif backend == "llama_cpp":
            path: Path = request.getfixturevalue("smollm2_path")
            d = create_drafter("llama_cpp", str(path), n_threads=1, **opts)
        elif backend == "onnx":
            d = create_drafter("onnx", str(request.getfixturevalue("onnx_tiny")), **opts)
        elif backend == "onnx_int8":
            d = create_drafter("onnx", str(request.getfixturevalue("onnx_tiny_int8")), **opts)
        else:
            d = create_drafter("torch", "tiny", **opts)
        made.append(d)
        return d

    yield factory
    for d in made:
        d.close()


def _prompt(d: Drafter) -> list[int]:
    ids = d.tokenizer.encode(PROMPT)
    return ids if d.name != "fake" else ids[:12]


def assert_same_distribution(got: np.ndarray, ref: np.ndarray, backend: str) -> None:
    assert got.shape == ref.shape and got.dtype == np.float32
    if backend == "fake":
        np.testing.assert_array_equal(got, ref)
    elif backend in ("torch", "onnx", "onnx_int8"):
        np.testing.assert_allclose(got, ref, atol=TORCH_ATOL, rtol=0)
    else:
        p, q = _softmax(got), _softmax(ref)
        tv = 0.5 * float(np.abs(p - q).sum())
        assert tv <= LLAMA_SELF_TV, f"total variation {tv:.4f} over {LLAMA_SELF_TV}"
        assert int(np.argmax(p)) in np.argsort(-q)[:5]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - float(x.max()))
    p: np.ndarray = e / e.sum()
    return p


def _path_tokens(d: Drafter, node: int) -> list[int]:
    return [d.node_token(n) for n in d.path_to(node)]


# ------------------------------------------------------------------------------------ contract
def test_sync_returns_read_only_logits(make: Factory) -> None:
    d = make()
    s = _prompt(d)
    logits = d.sync(s)
    assert logits.shape == (d.vocab_size,) and logits.dtype == np.float32
    assert np.all(np.isfinite(logits))
    with pytest.raises(ValueError):
        logits[0] = 1.0  # kept by the drafter: callers copy before modifying
    again = d.sync(s)  # nothing new: no evaluation, the same logits
    assert d.stats.sync_tokens == len(s)
    np.testing.assert_array_equal(again, logits)
    assert d.committed_len == len(s) and d.committed_tokens() == s


def test_extend_matches_a_fresh_sync_of_each_path(make: Factory, backend: str) -> None:
    d, ref = make(), make()
    s = _prompt(d)
    root = d.sync(s)
    top = [int(t) for t in np.argsort(-root)[:3]]
    # level 1: three children of the committed end
    out1 = d.extend([-1, -1, -1], top)
    assert out1.shape == (3, d.vocab_size)
    # level 2 and 3 in ONE call: a chain below node 0, a sibling, and a child of a node of this call
    out2 = d.extend([0, 0, 3, 1, 5], [11, 12, 13, 14, 15])
    assert d.num_nodes == 8
    assert [d.node_depth(n) for n in range(8)] == [1, 1, 1, 2, 2, 3, 2, 4]
    assert d.num_leaves == 4  # nodes 2, 4, 6, 7
    rows = np.concatenate([out1, out2])
    for node in range(8):
        assert_same_distribution(rows[node], ref.sync(s + _path_tokens(d, node)), backend)
        np.testing.assert_array_equal(d.logits_at(node), rows[node])


def test_sync_keeps_the_accepted_path(make: Factory, backend: str) -> None:
    d, ref = make(), make()
    s = _prompt(d)
    d.sync(s)
    d.extend([-1, -1], [21, 22])
    out = d.extend([0, 0, 1], [23, 24, 25])
    accepted = [21, 24]  # path to node 3
    before = d.stats.sync_tokens
    exact = d.sync(s + accepted)  # the verdict had no bonus: nothing to evaluate
    assert d.stats.sync_tokens == before
    np.testing.assert_array_equal(exact, out[1])
    assert d.num_nodes == 0 and d.committed_len == len(s) + 2

    d.extend([-1, 0], [31, 32])
    before = d.stats.sync_tokens
    got = d.sync(s + accepted + [31, 32, 33])  # accepted path and a bonus: only the bonus is new
    assert d.stats.sync_tokens == before + 1
    assert_same_distribution(got, ref.sync(s + accepted + [31, 32, 33]), backend)
    if isinstance(d, FakeDrafter):
        assert d.evaluated_tokens == len(s) + 5 + 2 + 1


def test_sync_to_a_prefix_or_another_text(make: Factory, backend: str) -> None:
    d, ref = make(), make()
    s = _prompt(d)
    d.sync(s)
    d.extend([-1, 0], [5, 6])
    got = d.sync(s[:-3])  # a strict prefix: its last token is re-evaluated
    assert_same_distribution(got, ref.sync(s[:-3]), backend)
    other = [7, 8, 9, *s]
    assert_same_distribution(d.sync(other), ref.sync(other), backend)


def test_the_workspace_holds_conditional_trees(make: Factory, backend: str) -> None:
    """Pre-speculation: after a tree, assume 'node 1 accepted, then bonus 40' and draft below it."""
    d, ref = make(), make()
    s = _prompt(d)
    d.sync(s)
    d.extend([-1, 0, 0], [21, 22, 23])
    bonus = d.extend([1], [40])  # node 3: the assumed bonus after node 1
    sub = d.extend([3, 3, 4], [41, 42, 43])  # its subtree, two levels in one call
    assert d.node_depth(6) == 5
    for node, row in [(3, bonus[0]), (4, sub[0]), (5, sub[1]), (6, sub[2])]:
        assert_same_distribution(row, ref.sync(s + _path_tokens(d, node)), backend)
    # the verdict: node 1 accepted, bonus 40, then the conditional tree's node 4 accepted, bonus 44
    before = d.stats.sync_tokens
    got = d.sync([*s, 21, 22, 40, 41, 44])
    assert d.stats.sync_tokens == before + 1
    assert_same_distribution(got, ref.sync([*s, 21, 22, 40, 41, 44]), backend)


def test_leaf_capacity_error_is_clear_and_changes_nothing(make: Factory) -> None:
    d = make(max_leaves=2)
    d.sync(_prompt(d))
    d.extend([-1, 0, 1, 2], [5, 6, 7, 8])  # a chain is one branch
    d.extend([-1], [9])
    with pytest.raises(WorkspaceFullError, match="max_leaves"):
        d.extend([0], [10])  # a third branch
    assert d.num_nodes == 5 and d.num_leaves == 2
    d.extend([3, 4], [11, 12])  # continuing leaves adds no branch
    assert d.num_leaves == 2


def test_node_capacity_and_context_errors(make: Factory) -> None:
    d = make(max_nodes=4, max_context=40)
    s = _prompt(d)
    d.sync(s)
    with pytest.raises(WorkspaceFullError, match="max_nodes"):
        d.extend([-1, 0, 1, 2, 3], [1, 2, 3, 4, 5])
    assert d.num_nodes == 0
    with pytest.raises(ContextFullError, match="max_context"):
        d.sync(list(range(1, 42)))
    assert d.committed_tokens() == s  # the failed sync changed nothing


def test_bad_input_is_refused(make: Factory) -> None:
    d = make()
    with pytest.raises(DrafterError, match="sync"):
        d.extend([-1], [1])
    with pytest.raises(ValueError, match="at least one"):
        d.sync([])
    with pytest.raises(ValueError, match="out of range"):
        d.sync([d.vocab_size])
    d.sync(_prompt(d))
    with pytest.raises(ValueError, match="earlier node"):
        d.extend([-1, 1], [1, 2])
    with pytest.raises(ValueError, match="out of range"):
        d.extend([-1], [-1])
    with pytest.raises(ValueError, match="length"):
        d.extend([-1, -1], [1])
    assert d.num_nodes == 0
    assert d.extend([], []).shape == (0, d.vocab_size)


def test_workspace_queries(make: Factory) -> None:
    d = make()
    s = _prompt(d)
    d.sync(s)
    d.extend([-1, 0, 0, 2], [5, 6, 7, 8])
    assert d.find_child(-1, 5) == 0 and d.find_child(0, 7) == 2 and d.find_child(0, 5) is None
    assert d.path_to(3) == [0, 2, 3] and d.path_to(-1) == []
    assert d.node_parent(3) == 2 and d.node_token(3) == 8 and d.node_depth(-1) == 0
    assert d.logits_at(-1).shape == (d.vocab_size,)
    assert d.stats.extend_calls == 1 and d.stats.extend_nodes == 4


def test_closed_drafter_refuses_work(make: Factory) -> None:
    d = make()
    d.sync(_prompt(d))
    d.close()
    with pytest.raises(DrafterError, match="closed"):
        d.sync([1, 2])
    d.close()  # twice is fine


def test_fingerprint_is_the_tokenizers(make: Factory) -> None:
    d = make()
    assert d.vocab_fingerprint() == d.tokenizer.fingerprint
    assert len(d.vocab_fingerprint()) == 64


def test_raw_text_reads_special_token_texts_as_text(make: Factory, backend: str, smollm2_path: Path) -> None:
    """encode(parse_special=False), what a raw prompt (`generate(..., raw=True)`, HumanEval's code)
    uses: "<|im_end|>" written in the text is text, tokenized as llama.cpp tokenizes it."""
    if backend == "fake":
        pytest.skip("the fake drafter's tokenizer has no special tokens")
    from edge_client.tokenizer import LlamaCppTokenizer

    tok, ref = make().tokenizer, LlamaCppTokenizer(smollm2_path)
    text = "def f():\n    return '<|im_end|>' + \"<|im_start|>\""
    raw = tok.encode(text, add_special=False, parse_special=False)
    assert raw == ref.encode(text, add_special=False, parse_special=False)
    assert 2 not in raw and 1 not in raw  # neither special token
    assert tok.encode(text, add_special=False).count(2) == 1  # parsed, it is the special token
    plain = "def f():\n    return 1"
    assert tok.encode(plain, parse_special=False) == tok.encode(plain)


# ------------------------------------------------------------------------------------ registry
def test_registry_names_and_errors() -> None:
    assert set(available_backends()) >= {"llama_cpp", "torch", "onnx"}
    with pytest.raises(ValueError, match="llama_cpp"):
        backend_class("onnx-nope")
    assert backend_class("llama_cpp").name == "llama_cpp"


# ------------------------------------------------------------------------------------ torch details
def test_torch_tokenizer_matches_llama_cpp(smollm2_path: Path) -> None:
    """The torch drafter's tokenizer (the cloud runtime's, adapted) and llama.cpp's agree."""
    if not _torch_available():
        pytest.skip("shared.model (the torch runtime) is not available")
    from edge_client.tokenizer import LlamaCppTokenizer

    d = create_drafter("torch", "tiny", max_context=64, max_nodes=8)
    try:
        theirs, ours = d.tokenizer, LlamaCppTokenizer(smollm2_path)
        assert theirs.fingerprint == ours.fingerprint == d.vocab_fingerprint()
        assert theirs.eos_ids and set(theirs.eos_ids) <= set(ours.eos_ids)
        for text in [PROMPT, "naïve café 你好 🙂\n\tend", "<|im_start|>user\nhi<|im_end|>"]:
            ids = ours.encode(text)
            assert theirs.encode(text) == ids
            assert theirs.decode(ids) == ours.decode(ids)
            assert theirs.decode(ids, special=True) == ours.decode(ids, special=True)
        sample = range(0, ours.vocab_size, 97)
        assert [theirs.token_bytes(i) for i in sample] == [ours.token_bytes(i) for i in sample]
    finally:
        d.close()


# ------------------------------------------------------------------------------------ malformed GGUFs
_LOAD_EACH = """
import sys
from edge_client.drafters.registry import create_drafter
from shared.gguf_check import GGUFError
for path in sys.argv[1:]:
    for backend in ("llama_cpp", "auto"):
        try:
            create_drafter(backend, path, max_context=64, max_nodes=8, max_leaves=4).close()
            print("loaded", backend, path, flush=True)
        except GGUFError as exc:
            print("refused", backend, exc, flush=True)
"""


def test_llama_cpp_refuses_a_malformed_gguf_with_an_exception_not_an_abort(tmp_path: Path) -> None:
    """A GGUF declaring 0, 100000 or 2^32-1 blocks (or any other malformed header) used to abort
    the process inside llama.cpp (SIGABRT and a debugger backtrace), through `--drafter llama_cpp`
    and `auto` alike: now the load raises GGUFError, one line naming the file and the field. In a
    subprocess, so an abort fails the test instead of ending the test run."""
    import subprocess
    import sys

    paths, wants = [], []
    for make, want in MALFORMED.values():
        paths.append(str(make(tmp_path)))
        wants.append(want)
    paths.append(str(write_tiny_gguf(tmp_path / "valid.gguf")))
    r = subprocess.run(
        [sys.executable, "-c", _LOAD_EACH, *paths], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    expected = [f"refused {b} {p}: " for p in paths[:-1] for b in ("llama_cpp", "auto")]
    assert [line[: len(e)] for line, e in zip(lines, expected, strict=False)] == expected
    for i, want in enumerate(wants):
        assert want in lines[2 * i] and want in lines[2 * i + 1], lines[2 * i]
    assert lines[-2:] == [f"loaded llama_cpp {paths[-1]}", f"loaded auto {paths[-1]}"]


@pytest.mark.parametrize("command", ["generate"])
def test_the_edge_cli_says_what_is_wrong_with_a_draft_gguf_in_one_line(tmp_path: Path, command: str) -> None:
    import socket
    import subprocess
    import sys

    make, want = MALFORMED["2^32-1 blocks"]
    path = make(tmp_path)
    server = ["--server", "ws://127.0.0.1:9/v1/session", "--draft", str(path)]
    if command == "generate":
        args = ["generate", *server, "--drafter", "llama_cpp", "hi"]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args = ["serve", *server, "--port", str(s.getsockname()[1])]  # --drafter auto
    cmd = [sys.executable, "-m", "edge_client", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(
        f"edge-client: error: cannot load the draft model {str(path)!r}: {path}: {want}"
    )


def test_the_torch_drafter_refuses_a_malformed_gguf(tmp_path: Path) -> None:
    if not _torch_available():
        pytest.skip("shared.model (the torch runtime) is not available")
    from shared.gguf_check import GGUFError

    make, want = MALFORMED["no KV heads"]
    with pytest.raises(GGUFError, match=want):
        create_drafter("torch", str(make(tmp_path)))
