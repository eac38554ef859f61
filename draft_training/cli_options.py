"""The settings of every `draft-training` subcommand (draft_training.cli runs them): each field of an
options dataclass is one of its subcommand's flags, with its help, its default and its parser in the
field's `cli` metadata (shared.config_cli makes the parser). Every number and name is checked as it
is parsed (shared.cli_args), so that a value out of range is a usage error naming the flag (exit
status 2) before anything is loaded. A field without a default is a required flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from shared.cli_args import integer, nonempty, number, positive_int
from shared.config_cli import cli, config_values
from shared.model_store import DEFAULT_TARGET

COUNT = integer(0)  # a count where 0 means "all" or "none"
SEED = integer(0, (1 << 31) - 1)
RATE = number(0.0, lo_open=True)  # a learning rate: finite and > 0
WEIGHT = number(0.0)  # a finite weight >= 0
MODEL = nonempty("the model")
DRAFT = "smollm2-135m-q4-l8"  # the draft distill, export and boost start from unless --draft


def _floats(text: str) -> tuple[float, ...]:
    """Comma-separated temperatures, each finite and >= 0 (CollectConfig.check bounds them above)."""
    one = number(0.0)
    return tuple(one(x) for x in text.split(",") if x.strip())


def _blocks(text: str) -> str:
    """Comma-separated block indices (>= 0); empty: every block."""
    for b in text.split(","):
        if b.strip():
            integer(0)(b)
    return text


def _progress(help: str = "no progress bar") -> bool:
    """The `--no-progress` switch (the field is True unless it is given)."""
    return field(default=True, metadata=cli(help, flag="--no-progress"))


def _autocast() -> str:
    """`--autocast` of the subcommands that train."""
    return field(
        default="none",
        metadata=cli(
            "bf16: the training forward and backward under CPU bf16 autocast (faster where the CPU has "
            "AMX or AVX-512 BF16, docs/training.md); the loss, weights and optimizer stay float32",
            choices=("none", "bf16"),
        ),
    )


@dataclass(frozen=True, kw_only=True)
class SplitOptions:
    """`draft-training split`."""

    COMMAND: ClassVar[str] = "split"
    HELP: ClassVar[str] = "write the fixed train / held-out split of the benchmark prompts"
    DESCRIPTION: ClassVar[str] = (
        "Write draft_training/data/split.json: per category, prompts ordered by "
        "sha256('category/id'), the first third held out. --check compares the committed file instead."
    )

    check: bool = field(default=False, metadata=cli("exit 1 if the committed split is not the rule's"))
    prompts_out: Path | None = field(
        default=None,
        metadata=cli(
            "instead: write one side of the committed split as a JSONL prompt file that "
            "bench.end_to_end.e2e, bench.end_to_end.network and bench.simulation.outcomes read with "
            "--prompt-file (to measure trained drafts)",
            type=Path,
            metavar="FILE",
        ),
    )
    side: str = field(
        default="heldout",
        metadata=cli("the side --prompts-out writes", choices=("train", "heldout")),
    )
    per_category: int = field(
        default=0,
        metadata=cli("with --prompts-out: the first N prompts of each category (0: all)", type=COUNT),
    )


@dataclass(frozen=True, kw_only=True)
class CollectOptions:
    """`draft-training collect`."""

    COMMAND: ClassVar[str] = "collect"
    HELP: ClassVar[str] = "the teacher's continuations of the train prompts with its top-k probabilities"
    DESCRIPTION: ClassVar[str] = (
        "Continue every train prompt with the fp32 target (greedy and sampled), storing each "
        "position's token, the teacher's top-k probabilities and the remaining mass; resumable."
    )

    out: Path = field(metadata=cli("output folder (created; resumed if it exists)", type=Path))
    model: str = field(
        default=DEFAULT_TARGET, metadata=cli("the target (teacher): alias or GGUF path", type=MODEL)
    )
    tokens: int = field(default=128, metadata=cli("new tokens per record at most", type=positive_int()))
    temperatures: tuple[float, ...] = field(
        default=(0.0, 1.0),
        metadata=cli("decoding temperatures, one record per prompt each (0: greedy)", type=_floats),
    )
    batch: int = field(default=4, metadata=cli("sequences per forward", type=positive_int()))
    top_k: int = field(
        default=32, metadata=cli("teacher probabilities kept per position", type=positive_int())
    )
    seed: int = field(default=0, metadata=cli("seeds the sampled records (each from its name)", type=SEED))
    limit: int = field(default=0, metadata=cli("only the first N train prompts (0: all)", type=COUNT))
    split: Path | None = field(
        default=None, metadata=cli("split file (default: the committed one)", type=Path)
    )
    side: str = field(
        default="train",
        metadata=cli(
            "which prompts: train (to distill on) or heldout (to evaluate on, never trained on)",
            choices=("train", "heldout"),
        ),
    )
    from_traces: Path | None = field(
        default=None,
        metadata=cli(
            "instead of generating: the sessions `edge-client generate --record DIR` logged (the "
            "target's own tokens), with the teacher's distribution at every position (one forward per "
            "session)",
            type=Path,
            metavar="DIR",
        ),
    )
    progress: bool = _progress()


@dataclass(frozen=True, kw_only=True)
class DistillOptions:
    """`draft-training distill`."""

    COMMAND: ClassVar[str] = "distill"
    HELP: ClassVar[str] = "train the draft towards the teacher's records (KL + 0.1 CE), full blocks or LoRA"
    DESCRIPTION: ClassVar[str] = (
        "Distill the draft from collect's records: forward KL on the teacher's stored top-k + "
        "rest (or TVD) plus 0.1 x cross-entropy on its token; deterministic with --seed; checkpoints and "
        "resumes in --out; evaluates held-out top-1 and simulated tau on --heldout records."
    )

    records: Path = field(metadata=cli("a collect folder of train records", type=Path))
    heldout: Path | None = field(
        default=None, metadata=cli("a collect folder of held-out records", type=Path)
    )
    out: Path = field(metadata=cli("run folder (checkpoints; resumed if it exists)", type=Path))
    draft: str = field(default=DRAFT, metadata=cli("the draft to train: alias or GGUF path", type=MODEL))
    steps: int = field(default=200, metadata=cli("optimizer steps", type=positive_int()))
    batch: int = field(default=4, metadata=cli("records per step", type=positive_int()))
    lr: float = field(default=1e-4, metadata=cli("AdamW learning rate", type=RATE))
    loss: str = field(default="kl", metadata=cli("divergence from the teacher", choices=("kl", "tvd")))
    ce_weight: float = field(default=0.1, metadata=cli("weight of the cross-entropy term", type=WEIGHT))
    blocks: str = field(
        default="", metadata=cli("blocks to train, e.g. 4,5,6,7 (default: all)", type=_blocks)
    )
    lora_rank: int = field(default=0, metadata=cli("LoRA rank (0: full fine-tuning of --blocks)", type=COUNT))
    lora_alpha: float = field(default=16.0, metadata=cli("LoRA scale numerator (alpha / rank)", type=RATE))
    lora_targets: str = field(default="qkv,o,gate_up,down", metadata=cli("projections LoRA adapts"))
    eval_every: int = field(default=50, metadata=cli("steps between held-out evaluations", type=COUNT))
    checkpoint_every: int = field(default=50, metadata=cli("steps between checkpoints", type=COUNT))
    max_positions: int = field(default=0, metadata=cli("teacher positions per record (0: all)", type=COUNT))
    seed: int = field(default=0, metadata=cli("seeds the record order and the LoRA init", type=SEED))
    validation: float = field(
        default=0.0,
        metadata=cli(
            "the share of train prompts set apart (never trained on) and evaluated at --eval-every, to "
            "choose the kept step with --keep best (0: none)",
            type=number(0.0, 1.0),
        ),
    )
    keep: str = field(
        default="last",
        metadata=cli(
            "the draft written: the last step's, or the step of the best validation top-1 (needs "
            "--validation; the --heldout records never choose it)",
            choices=("last", "best"),
        ),
    )
    autocast: str = _autocast()
    progress: bool = _progress()


@dataclass(frozen=True, kw_only=True)
class ExportOptions:
    """`draft-training export`."""

    COMMAND: ClassVar[str] = "export"
    HELP: ClassVar[str] = (
        "write a distill run's draft as a GGUF llama.cpp runs (tensors training left alone copied)"
    )
    DESCRIPTION: ClassVar[str] = (
        "Write the trained draft (RUN/draft.safetensors) as a GGUF: the draft's own GGUF with "
        "every tensor training changed rewritten (F32, or Q8_0) and the rest copied byte for byte."
    )

    run: Path = field(metadata=cli("a distill run folder (holds draft.safetensors)", type=Path))
    draft: str = field(default=DRAFT, metadata=cli("the draft the run trained: alias or GGUF", type=MODEL))
    gguf_type: str = field(default="f32", metadata=cli("type of rewritten tensors", choices=("f32", "q8_0")))
    out: Path | None = field(
        default=None,
        metadata=cli("output GGUF (default: RUN/draft.gguf, with --lora RUN/lora.gguf)", type=Path),
    )
    name: str | None = field(
        default=None,
        metadata=cli(
            "also give the draft a name: written to <cache>/models/trained/NAME.gguf (with "
            "NAME.gguf.json: the run and base it came from), so `--draft NAME` runs it in every drafter "
            "backend (instead of --out; a-z 0-9 . _ -, not an alias)",
            type=nonempty("the name"),
        ),
    )
    lora: bool = field(
        default=False,
        metadata=cli(
            "write the LoRA run's adapters alone as a llama.cpp adapter GGUF (from RUN/checkpoint), "
            "applied at run time on the unchanged --draft by `edge-client generate --draft-lora FILE`"
        ),
    )


@dataclass(frozen=True, kw_only=True)
class BoostOptions:
    """`draft-training boost`."""

    COMMAND: ClassVar[str] = "boost"
    HELP: ClassVar[str] = (
        "SSM_2..m trained on what the SSMs before them miss (SpecInfer's boost-tuning, adapted)"
    )
    DESCRIPTION: ClassVar[str] = (
        "Train SSM_2..m from the base draft, each on the train records weighted by what SSM_1.."
        "SSM_j-1 already cover (draft_training.boost), and, as the control, as many SSMs trained "
        "independently; writes OUT/boost.json with single and union held-out top-1."
    )

    records: Path = field(metadata=cli("a collect folder of train records", type=Path))
    heldout: Path = field(metadata=cli("a collect folder of held-out records", type=Path))
    ssm1: Path = field(metadata=cli("SSM_1: a distill run folder (its draft.safetensors)", type=Path))
    out: Path = field(metadata=cli("output folder (each SSM's run; resumed if it exists)", type=Path))
    draft: str = field(default=DRAFT, metadata=cli("the base draft every SSM starts from", type=MODEL))
    m: int = field(default=3, metadata=cli("SSMs at most, SSM_1 included", type=integer(2)))
    criterion: str = field(
        default="token", metadata=cli("token (default), window:N, or sequence (the paper's rule)")
    )
    control: bool = field(
        default=True, metadata=cli("skip the independently trained SSMs", flag="--no-control")
    )
    min_gain: float = field(
        default=0.01, metadata=cli("stop when union top-1 grows less than this", type=WEIGHT)
    )
    steps: int = field(default=200, metadata=cli("optimizer steps per SSM", type=positive_int()))
    batch: int = field(default=4, metadata=cli("records per step", type=positive_int()))
    autocast: str = _autocast()
    lr: float = field(default=3e-4, metadata=cli("AdamW learning rate", type=RATE))
    max_positions: int = field(default=0, metadata=cli("teacher positions per record (0: all)", type=COUNT))
    seed: int = field(
        default=0, metadata=cli("SSM_j trains with seed + j - 1 (control: + 100 + j)", type=SEED)
    )
    progress: bool = _progress()


@dataclass(frozen=True, kw_only=True)
class DraftsOptions:
    """`draft-training drafts`; its positional ALIAS arguments (`aliases`) are no flag: the
    parser adds them by hand (draft_training.cli)."""

    COMMAND: ClassVar[str] = "drafts"
    HELP: ClassVar[str] = "build the default trained drafts into the model cache (what `make drafts` runs)"
    DESCRIPTION: ClassVar[str] = (
        "Collect, distill and export each recipe's draft (draft_training.drafts) into the "
        "model cache under its alias (e.g. smollm2-135m-l8-kd, about an hour on 2 cores). Every step "
        "resumes an interrupted build; a built alias is kept unless --rebuild."
    )
    ALIASES_HELP: ClassVar[str] = "which recipes (default: all of them)"

    aliases: tuple[str, ...] = ()
    rebuild: bool = field(default=False, metadata=cli("train again even if the alias is built"))
    qwen: bool = field(
        default=False,
        metadata=cli(
            "also the Qwen pilot qwen2.5-coder-0.5b-kd (LoRA of the 0.5B taught by the 1.5B); "
            "make drafts QWEN=1"
        ),
    )
    progress: bool = _progress("no progress bars")


Options = SplitOptions | CollectOptions | DistillOptions | ExportOptions | BoostOptions | DraftsOptions
# the subcommands in the order `draft-training --help` lists them
COMMANDS: tuple[type[Options], ...] = (
    SplitOptions,
    CollectOptions,
    DistillOptions,
    ExportOptions,
    BoostOptions,
    DraftsOptions,
)


def options_from_args(args: argparse.Namespace) -> Options:
    """The options of the subcommand `args` were parsed for (its flags read back by field name)."""
    cls = next(c for c in COMMANDS if c.COMMAND == args.command)
    values = config_values(cls, args)
    if cls is DraftsOptions:
        values["aliases"] = tuple(args.aliases)
    return cls(**values)


__all__ = [
    "COMMANDS",
    "BoostOptions",
    "CollectOptions",
    "DistillOptions",
    "DraftsOptions",
    "ExportOptions",
    "Options",
    "SplitOptions",
    "options_from_args",
]
