"""The contract both sides import: wire protocol (sans I/O), token trees, sparse distributions."""

from shared.errors import CloseCode, ErrorCode, ProtocolError
from shared.sparse import Q_TOTAL, SparseDist, SparseRows
from shared.tree import DEFAULT_EXPANSION, Draws, ExpansionConfig, TokenTree, merge
from shared.vocab import vocab_fingerprint

__all__ = [
    "DEFAULT_EXPANSION",
    "Q_TOTAL",
    "CloseCode",
    "Draws",
    "ErrorCode",
    "ExpansionConfig",
    "ProtocolError",
    "SparseDist",
    "SparseRows",
    "TokenTree",
    "merge",
    "vocab_fingerprint",
]
