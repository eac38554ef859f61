"""The target's tokenizer: ids <-> text, the vocabulary as stored in the model, the chat template.

Built with the `tokenizers` library, either from GGUF metadata (byte-level BPE: tokens + merges +
the pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`) or from a Hugging Face `tokenizer.json`.
`token_texts()` is the vocabulary exactly as the model stores it, which is what the vocabulary
fingerprint (PROTOCOL.md section 8) hashes, so it is kept apart from the tokenizer object (whose own
view may add or drop entries).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# Split rules named by llama.cpp's `tokenizer.ggml.pre` (the regexes the merges were learned with).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
CONTROL = 3  # llama.cpp token type of special tokens such as <|im_end|>
USER_DEFINED = 4


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":  # every digit alone, then GPT-2's split
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _SPLITS.get(pre or "", _GPT2_SPLIT)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def bpe_from_gguf(
    tokens: Sequence[str],
    merges: Sequence[str],
    token_types: Sequence[int] | None,
    pre: str | None,
    bos_id: int | None,
    add_bos: bool,
) -> Tokenizer:
    """A byte-level BPE tokenizer from GGUF `tokenizer.ggml.*` metadata (tokenizer model gpt2)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))  # type: ignore[arg-type]
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    if token_types is not None:
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, token_types, strict=True)
            if k == CONTROL
        ]
        plain = [
            AddedToken(t, normalized=False)
            for t, k in zip(tokens, token_types, strict=True)
            if k == USER_DEFINED
        ]
        tok.add_special_tokens(special)
        tok.add_tokens(plain)
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok


class TargetTokenizer:
    """Encodes and decodes the target's token ids and renders its chat template."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        token_texts: Sequence[str],
        chat_template: str | None,
        bos_id: int | None,
        eos_ids: Sequence[int],
    ) -> None:
        self.tokenizer = tokenizer
        self._texts = list(token_texts)
        self.chat_template = chat_template
        self.bos_id = bos_id
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    def token_texts(self) -> list[str]:
        """The vocabulary in id order, as stored in the model (what the fingerprint hashes)."""
        return list(self._texts)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids of `text`; add_special adds what the model's tokenizer adds (e.g. BOS).

        Special tokens written in the text (e.g. <|im_start|> from a chat template) stay whole.
        """
        return list(self.tokenizer.encode(text, add_special_tokens=add_special).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special))

    def token_text(self, token_id: int) -> str:
        return self._texts[token_id]

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render the model's chat template (jinja2, sandboxed, as Hugging Face renders it)."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        bos = self._texts[self.bos_id] if self.bos_id is not None else ""
        eos = self._texts[self.eos_ids[0]] if self.eos_ids else ""
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            **kwargs,
        )


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _jinja_env() -> jinja2.Environment:
    # trim_blocks / lstrip_blocks: the whitespace rules chat templates are written for
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def placeholder_tokenizer() -> TargetTokenizer:
    """A one-word tokenizer for the weight files of models that have none (random weights in
    benchmarks and tests of the weights alone): it fills a weight-cache entry's tokenizer files."""
    from tokenizers.models import WordLevel

    return TargetTokenizer(Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")), ["<unk>"], None, None, ())
