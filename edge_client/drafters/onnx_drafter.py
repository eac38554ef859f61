"""onnxruntime drafter: an exported draft model (edge_client.onnx.export), one `run` per tree level.

The KV cache lives here, in one numpy buffer [max_context + max_nodes, layers, kv_heads, head_dim]
per K and V, row r = the token at row r of this layout:

    rows [0, L)              the committed sequence (L = committed_len)
    rows [L, L + num_nodes)  the workspace's draft nodes, in node-id order

An `extend` of n nodes is ONE run: past = buf[:L + first] (a contiguous prefix, handed to
onnxruntime without a copy), the n new rows, and an additive mask [n, L + first + n] that lets each
new node see the committed rows, its workspace ancestors and itself; the returned K/V rows are
written after the existing ones. So, unlike the torch reference, the workspace IS cached and each
tree level costs only its own rows. `sync` moves the K/V rows of an accepted path down to follow
the committed rows (a path's node ids increase, so copying in path order never overwrites a row
still to be read) and evaluates only the rest, causally, in chunks.

Runtime needs only numpy, onnxruntime and tokenizers (no torch): the tokenizer is the export's.
Models: an export folder, or a draft alias / GGUF path / `tiny`, exported into the model cache on
first use (needs torch and onnx then, once). Either way every file is checked against the
manifest's checksums before it is loaded (edge_client.onnx.export.read_manifest, ensure_export).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.drafters.base import Drafter, DrafterError
from edge_client.onnx.export import (
    INT8_LAYOUT,
    MANIFEST,
    MODEL_FILE,
    ExportError,
    Manifest,
    check_manifest,
    ensure_export,
    read_manifest,
)
from edge_client.stored_tokenizer import StoredTokenizer

CHUNK = 256  # committed tokens per run when a sync evaluates a long tail (bounds the score matrix)
_MASKED = np.float32(np.finfo(np.float32).min)


def resolve_export(
    model: str | Path, int8: bool | None, *, export: bool, progress: bool
) -> tuple[Path, bool]:
    """The export folder for `model` and whether its files are checked already: the folder itself,
    or the cached export of an alias/path (int8 unless `int8` is False: the fast export, the one
    `--drafter auto` measures and picks), checked (and made again when it fails) by ensure_export."""
    path = Path(model)
    if path.is_dir():
        return path, False
    want = int8 is not False
    if not export:
        from edge_client.onnx.export import cache_folder

        folder = cache_folder(str(model), want)
        if not (folder / MANIFEST).is_file():
            raise ExportError(
                f"no ONNX export of {model} in {folder}; run `edge-client export-onnx --draft {model} "
                f"--out DIR{' --int8' if want else ''}` and pass DIR, or allow exporting on first use"
            )
        check_manifest(read_manifest(folder), folder, source=str(model))
        return folder, True
    return ensure_export(str(model), int8=want, progress=progress), True


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "1.22.0" or "1.23.0.dev20250101"."""
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in text.split(".")[:2])


class OnnxDrafter(Drafter):
    """A draft model exported to ONNX, run by onnxruntime on the CPU.

    model:       an export folder (edge-client export-onnx), or a draft alias / GGUF path / `tiny`
                 (exported into the model cache on first use, with a progress message)
    int8:        None: whatever an export folder holds, and for an alias / GGUF path its int8
                 export (the fast one, as `--drafter auto` picks); True/False: require (and
                 export) that precision, False for the fp32 export of an alias
    n_threads:   onnxruntime intra-op threads, 1 by default (the edge drafts on one core)
    max_context, max_nodes, max_leaves: as for every drafter (see base.Drafter); the KV buffer
                 holds max_context + max_nodes rows
    export:      allow exporting an alias or path on first use
    """

    name = "onnx"

    def __init__(
        self,
        model: str | Path = "smollm2-135m-q4",
        *,
        int8: bool | None = None,
        n_threads: int | None = None,
        max_context: int = 4096,
        max_nodes: int = 256,
        max_leaves: int = 255,
        export: bool = True,
        progress: bool = True,
    ) -> None:
        if max_context < 1 or max_nodes < 1 or max_leaves < 1:
            raise ValueError("max_context, max_nodes and max_leaves must be positive")
        import onnxruntime as ort

        super().__init__()
        self._session: Any = None
        folder, checked = resolve_export(model, int8, export=export, progress=progress)
        manifest = read_manifest(folder, verify=not checked)  # every file against its checksum
        check_manifest(manifest, folder, int8=int8)
        self.manifest: Manifest = manifest
        self.folder = folder
        self.model_id = str(model)
        self.vocab_size = manifest.vocab_size
        self.max_context = max_context
        self.max_nodes = max_nodes
        self.max_leaves = max_leaves
        self.tokenizer = StoredTokenizer(
            folder, bos_id=manifest.bos_id, eos_ids=manifest.eos_ids, chat_template=manifest.chat_template
        )
        if (
            self.tokenizer.vocab_size != manifest.vocab_size
            or self.tokenizer.fingerprint != manifest.fingerprint
        ):
            raise ExportError(
                f"{folder}: the stored tokenizer does not match the manifest (vocabulary size or "
                "fingerprint); the folder is damaged, export it again"
            )
        if manifest.int8_layout == INT8_LAYOUT and _version(ort.__version__) < (1, 22):
            raise ExportError(
                f"{folder} holds 8-bit MatMulNBits weights, which onnxruntime {ort.__version__} cannot "
                "run on this CPU; pip install 'onnxruntime>=1.22' (or use an fp32 export)"
            )
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = n_threads or 1
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self._session = ort.InferenceSession(
                str(folder / MODEL_FILE), sess_options=opts, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # onnxruntime's errors (InvalidGraph, ...) are not one type
            why = " ".join(str(exc).split())[:300]
            raise ExportError(
                f"{folder}: onnxruntime cannot load {MODEL_FILE} ({type(exc).__name__}: {why}); the "
                "export is damaged or was made from a malformed model: delete the folder and export again"
            ) from None
        names = [o.name for o in self._session.get_outputs()]
        if names[:3] != ["logits", "present_key", "present_value"]:
            raise ExportError(f"{folder / MODEL_FILE}: unexpected outputs {names}; export it again")
        rows = max_context + max_nodes
        self._k = np.zeros((rows, *manifest.kv_row_shape), dtype=np.float32)
        self._v = np.zeros_like(self._k)
        self._cached = 0  # committed rows in the buffer
        self._ws = 0  # workspace rows after them
        self._anc = np.zeros((max_nodes, max_nodes), dtype=bool)  # [node, node] ancestor-or-self

    def vocab_fingerprint(self) -> str:
        return self.manifest.fingerprint

    # ------------------------------------------------------------------ hooks
    def _commit(self, keep: int, path: list[int], tail: list[int]) -> np.ndarray | None:
        try:
            return self._commit_rows(keep, path, tail)
        except Exception:
            self._cached = self._ws = 0
            self._committed = []  # the buffer no longer matches: the next sync starts over
            raise

    def _commit_rows(self, keep: int, path: list[int], tail: list[int]) -> np.ndarray | None:
        base = self._cached
        self._cached = min(keep, self._cached)
        for j, node in enumerate(path):  # accepted workspace rows follow the committed ones
            src, dst = base + node, keep + j
            if src != dst:
                self._k[dst] = self._k[src]
                self._v[dst] = self._v[src]
        self._cached = keep + len(path)
        self._ws = 0
        out: np.ndarray | None = None
        for a in range(0, len(tail), CHUNK):
            chunk = tail[a : a + CHUNK]
            n, past = len(chunk), self._cached
            mask = np.zeros((n, past + n), dtype=np.float32)
            mask[:, past:][np.triu_indices(n, 1)] = _MASKED
            positions = np.arange(past, past + n, dtype=np.int64)
            logits = self._run(chunk, positions, mask, [n - 1], past)
            self._cached += n
            out = logits[0]
        return out

    def _evaluate(self, first: int, count: int) -> np.ndarray:
        past = self._cached + self._ws
        if self._ws != first:
            raise AssertionError(f"workspace rows {self._ws} != nodes {first}")
        if past + count > len(self._k):
            raise DrafterError("the KV buffer is full (max_context + max_nodes rows)")
        anc = self._anc
        for i in range(first, first + count):
            anc[i, : first + count] = False
            p = self._parents[i]
            if p >= 0:
                anc[i, :i] = anc[p, :i]
            anc[i, i] = True
        mask = np.zeros((count, past + count), dtype=np.float32)
        mask[:, self._cached :] = np.where(anc[first : first + count, : first + count], 0.0, _MASKED)
        positions = self.committed_len - 1 + np.asarray(self._depths[first : first + count], dtype=np.int64)
        out = self._run(self._tokens[first : first + count], positions, mask, range(count), past)
        self._ws += count
        return out

    def _drop_workspace(self) -> None:
        self._ws = 0

    # ------------------------------------------------------------------ internals
    def _run(
        self,
        tokens: Sequence[int],
        positions: np.ndarray,  # [n] int64
        mask: np.ndarray,  # [n, past + n] float32 additive
        logit_rows: Sequence[int] | range,
        past: int,
    ) -> np.ndarray:
        """One session run over n new rows after `past` buffered rows; appends their K/V at `past`."""
        n = len(tokens)
        logits, k, v = self._session.run(
            None,
            {
                "input_ids": np.asarray(tokens, dtype=np.int64),
                "position_ids": positions,
                "attention_mask": mask,
                "logit_rows": np.asarray(list(logit_rows), dtype=np.int64),
                "past_key": self._k[:past],
                "past_value": self._v[:past],
            },
        )
        self._k[past : past + n] = k
        self._v[past : past + n] = v
        return np.ascontiguousarray(logits, dtype=np.float32)  # [k, V]

    def close(self) -> None:
        super().close()
        self._session = None
        self._k = self._v = np.zeros((0,), dtype=np.float32)
