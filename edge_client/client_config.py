"""The edge client's settings: `EdgeConfig` (how the client drafts, connects and records; fixed for
its life) and `SamplingOptions` (what one generation samples, and how much of it). EdgeClient takes
either the dataclass or its fields as keyword arguments:

    EdgeClient(url, drafter, config=EdgeConfig(prespec=True, trace=True))
    EdgeClient(url, drafter, prespec=True, trace=True)  # the same config
    client.generate(prompt, SamplingOptions(temperature=0.7, seed=1))
    client.generate(prompt, temperature=0.7, seed=1)  # the same options
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from edge_client.session import ResumeConfig, Session, Timeouts
from edge_client.speculation.config import PrespecConfig, TreeSpec
from edge_client.transports import Link, Transport


@dataclass(frozen=True)
class EdgeConfig:
    """How an EdgeClient drafts, connects and records (everything but the drafters and sampling).

    api_key:    sent in the hello
    tree:       the tree shape drafted each round; with several drafters one per drafter (or one
                for all); after the first, a dynamic shape needs a fixed budget (None: TreeSpec())
    prespec:    pre-speculate conditional trees while a round is in flight (True: defaults)
    link:       wraps the transport, e.g. an emulated network link (bench.shaper.LinkShape)
    transport:  an async factory of the byte transport (default: a WebSocket to the server)
    wire_top_k: in mode mss / rrs, the draft probabilities sent per q row (the likeliest ids)
    couple:     in mode match at temperature > 0, draft with the verifier's keyed uniforms
                (edge_client.trees.Coupling): the first child at each node is the token the target
                samples wherever the draft's distribution is close to its own
    ca_file:    wss://: trust the verifier's certificate if this CA bundle (PEM) signed it
    resume:     reconnect when the connection drops and go on from the committed tokens (True:
                ResumeConfig defaults; False: a drop ends the generation with ConnectionLost)
    parallel_drafters: with several drafters, draft each round's trees at the same time, a thread
                per drafter (a merged round then costs the slowest drafter's time, given the cores);
                default: in turn on the one drafting thread
    timeouts:   how long to wait for the verifier's welcome, verdicts, cancel and close (Timeouts)
    trace:      record every send, verdict and draft evaluation of each generation on its stats
                (GenerationStats.trace, a stats.RoundTrace) for replaying the rounds (bench.simulate)
    """

    api_key: str | None = None
    tree: TreeSpec | Sequence[TreeSpec] | None = None
    prespec: bool | PrespecConfig = False
    link: Link | None = None
    transport: Callable[[], Awaitable[Transport]] | None = None
    wire_top_k: int = 48
    couple: bool = True
    ca_file: str | None = None
    resume: bool | ResumeConfig = True
    parallel_drafters: bool = False
    timeouts: Timeouts | None = None
    trace: bool = False

    def __post_init__(self) -> None:
        if self.wire_top_k < 1:
            raise ValueError(f"EdgeConfig.wire_top_k must be at least 1, got {self.wire_top_k}")

    @property
    def trees(self) -> tuple[TreeSpec | None, ...]:
        """The tree shapes as given: one, or one per drafter (None: the default shape)."""
        return (self.tree,) if self.tree is None or isinstance(self.tree, TreeSpec) else tuple(self.tree)

    @property
    def prespec_config(self) -> PrespecConfig | None:
        """The pre-speculation settings (None: off)."""
        if isinstance(self.prespec, PrespecConfig):
            return self.prespec
        return PrespecConfig() if self.prespec else None

    @property
    def resume_config(self) -> ResumeConfig | None:
        """The resume settings (None: a drop ends the generation)."""
        if isinstance(self.resume, ResumeConfig):
            return self.resume
        return ResumeConfig() if self.resume else None


@dataclass(frozen=True)
class SamplingOptions:
    """What one generation samples and when it ends (EdgeClient.generate).

    max_new_tokens: tokens to generate at most
    temperature:    0: greedy; above it the verification samples (mode match, mss, rrs)
    top_p, top_k:   nucleus mass and the k likeliest tokens kept (0: all)
    seed:           the keyed sampler's seed (the same seed, the same tokens)
    stop:           strings that end the generation (cut from the text)
    stop_ids:       token ids that end it (besides the model's end-of-generation ids)
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: Sequence[str] = ()
    stop_ids: Sequence[int] = ()


_Settings = TypeVar("_Settings", EdgeConfig, SamplingOptions)


def with_keywords(base: _Settings, keywords: Mapping[str, Any], owner: str) -> _Settings:
    """`base` with the fields named in `keywords` replaced; a TypeError naming `owner` for a keyword
    that is no field of it."""
    if not keywords:
        return base
    names = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(keywords) - names)
    if unknown:
        raise TypeError(
            f"{owner} got unexpected keyword arguments {', '.join(unknown)} "
            f"(the fields of {type(base).__name__}: {', '.join(sorted(names))})"
        )
    return dataclasses.replace(base, **keywords)


class ConfiguredSession(Session):
    """The session an EdgeConfig describes (its transport, link, key, resume and timeouts), whose
    hello announces the vocabulary `fingerprint()` names (the client's drafter's)."""

    def __init__(
        self, server: str | Sequence[str], fingerprint: Callable[[], str], config: EdgeConfig
    ) -> None:
        super().__init__(
            server,
            api_key=config.api_key,
            link=config.link,
            transport=config.transport,
            ca_file=config.ca_file,
            resume=config.resume,
            timeouts=config.timeouts,
        )
        self._fingerprint = fingerprint

    def vocab_fingerprint(self) -> str:
        return self._fingerprint()


__all__ = ["ConfiguredSession", "EdgeConfig", "SamplingOptions", "with_keywords"]
