"""A wire mode touches many places; this is their checklist (docs/architecture.md §10), and it fails
when a mode of `shared.messages.Mode` is missing from one of them:

1. PROTOCOL.md names it;
2. the TypeScript client's `MODES` lists it (clients/typescript/src/protocol.ts);
3. the verifier's trust policy allows it to trusted clients (cloud_verifier/auth.py);
4. `Algorithm.of` maps it to a verification algorithm (cloud_verifier/verify.py), or refuses it
   as `ar` (no tree), and the two agree on which modes are stochastic (draws with q rows);
5. the chi-square harness has a case for every sampled algorithm (cloud_verifier/exactness);
6. the edge drafts trees for it (`edge_client.trees.sampling.draft_mode`);
7. the edge CLI offers it (`edge-client generate --mode`).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from shared.messages import Mode

ROOT = Path(__file__).resolve().parents[1]
TREE_MODES = [m for m in Mode if m is not Mode.AR]


def _choices(parser: argparse.ArgumentParser, command: str, flag: str) -> list[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices[command]
            for a in sub._actions:
                if flag in a.option_strings:
                    return [str(c) for c in a.choices or []]
    raise AssertionError(f"{command} has no {flag}")


@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.value)
def test_protocol_and_typescript_client_name_every_mode(mode: Mode) -> None:
    protocol = (ROOT / "PROTOCOL.md").read_text(encoding="utf-8")
    assert f"`{mode.value}`" in protocol or f'"{mode.value}"' in protocol, f"PROTOCOL.md: {mode.value}"
    ts = (ROOT / "clients/typescript/src/protocol.ts").read_text(encoding="utf-8")
    listed = re.search(r"export const MODES = \[([^\]]*)\]", ts)
    assert listed and f'"{mode.value}"' in listed.group(1), f"protocol.ts MODES: {mode.value}"


def test_the_trust_policy_covers_every_mode() -> None:
    from cloud_verifier.auth import TRUSTED_MODES, UNTRUSTED_MODES

    assert set(TRUSTED_MODES) == set(Mode)
    assert set(UNTRUSTED_MODES) <= set(TRUSTED_MODES)
    # an untrusted client's trees carry no q rows the verifier would have to believe
    assert not any(m.stochastic for m in UNTRUSTED_MODES)


def test_every_tree_mode_has_an_algorithm_and_ar_has_none() -> None:
    from cloud_verifier.verify import Algorithm, SamplingParams

    sampled = SamplingParams(temperature=0.8)
    for mode in TREE_MODES:
        algorithm = Algorithm.of(mode, sampled)
        assert algorithm.value == mode.value
        assert algorithm.stochastic == mode.stochastic
    with pytest.raises(ValueError, match="no tree"):
        Algorithm.of(Mode.AR, sampled)


def test_the_chi_square_harness_has_a_case_for_every_sampled_mode() -> None:
    from cloud_verifier.exactness.cases import full_matrix
    from cloud_verifier.exactness.rounds import TREE_KIND

    covered = {case.algorithm for case in full_matrix()}
    for mode in TREE_MODES:
        assert mode.value in TREE_KIND, f"exactness.rounds.TREE_KIND: {mode.value}"
        if mode is not Mode.GREEDY:  # greedy is exact token for token (tests/cloud_verifier)
            assert mode.value in covered, f"exactness.cases.full_matrix: no case for {mode.value}"


def test_the_edge_drafts_every_tree_mode_and_the_clis_offer_every_mode() -> None:
    from edge_client.cli import build_parser
    from edge_client.trees.sampling import draft_mode

    for mode in TREE_MODES:
        assert draft_mode(mode.value) is mode
    with pytest.raises(ValueError):
        draft_mode(Mode.AR)
    # every verification mode, and auto (the default: it picks greedy or match round by round)
    assert set(_choices(build_parser(), "generate", "--mode")) == {m.value for m in Mode} | {"auto"}
