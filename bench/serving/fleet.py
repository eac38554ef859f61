"""The fleet's figures: what Serve's proxy adds to a verify round, where resumed sessions land, and
the tokens/s of one replica against two.

    python -m bench fleet --json bench/out/fleet.json
    python -m bench fleet --parts overhead --verify-sessions 20 --frames 300
    python -m bench fleet --parts resume --sessions 40
    python -m bench fleet --parts throughput --clients 8 --seconds 60
    python -m bench fleet --parts control_plane --seconds 30
    python -m bench fleet --no-direct       # every frame through Serve's proxy

A local Ray cluster runs here: Serve's proxy on a free loopback port and the fleet of `cloud-verifier
fleet` (its router sends a resume to the replica its token names), every replica started with the
flags the direct verifier gets (`--model`, `--threads`, no cost measurement, a fixed KV pool). As
`cloud-verifier fleet` does by default (`--direct`), each replica offers its own address and every
client of the fleet moves its sessions there (Serve's proxy routes them and keeps an idle
connection of each; the frames of the rounds bypass it); `--no-direct` keeps every frame on the
proxy. The parts (`--parts`, all by default):

- overhead: one replica. The same greedy sessions (random prompts, each round's tree scripted from
  the target's own continuation, `--nodes` nodes) go to a `cloud-verifier serve` process and through
  the fleet, alternately. Per verify round (the prompt's round, which carries the prefill, apart):
  median and 90th percentile ms of each, the difference in ms and as a share of the direct round;
  ms per token likewise (both generate the same tokens in the same rounds, which is checked); the
  session's opening (connect, hello, welcome, and with `--direct` the move) likewise. The
  proxy alone beside it: a 64-byte WebSocket echo, its connect and `GET /healthz`, on uvicorn and
  through Serve. Goal: the fleet adds at most 2 ms, or at most 5 % of ms per token, to a round.
- resume: two replicas. `--sessions` edge generations (the tiny torch drafter, resume on), each run
  once uninterrupted and once cut (the TCP connection aborted, no closing handshake) after a
  seeded random number of its verdicts, before the last; every cut output must equal the
  uninterrupted one. The fleet's `cloud_verifier_resumes_total{kv}` summed over replicas says where
  each resume landed: `reused` and `busy` on the replica holding the session, `gone` elsewhere.
  Goal: at least 95 % landed.
- throughput: a fleet of one replica, then of two, under the same load: `--clients` raw protocol
  clients in one event loop, no drafting model (`--load`: greedy sessions with prompt-lookup trees,
  several tokens a frame, or `ar`, one token a frame), sessions back to back for `--warmup` then
  `--seconds` seconds; tokens/s over all sessions in those seconds and the ratio. Goal: 1.7x, one
  core each: with `--pin` (the default) each replica's threads are confined to `--threads` cores of
  their own (the first replica to the first), so that a lone replica does not spread its event loop
  and engine over the idle cores. On a machine with few cores the client, Serve's proxy and Ray's
  own processes share them with the replicas (the CPU count is reported).
- control_plane: two replicas, no load. The CPU each kind of the cluster's own processes takes over
  `--seconds` (the Serve controller and proxy, GCS, the raylet, the fleet's board, Ray's agents), in %
  of one core, from /proc (Linux): what the replicas lose where they share the cores. No goal.

Exit status 1 when an output differs (a resumed generation from its uninterrupted run, or the
fleet's greedy tokens from the direct verifier's); goals missed are reported, not failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from bench.harness import Verifier, add_common_args, add_model_args, table
from bench.lib import runner
from bench.lib.fleet_cpu import control_plane
from bench.lib.fleet_throughput import cpu_count, plain_throughput, throughput
from bench.lib.runner import Result, UsageError
from bench.lib.stats import median, percentile

if TYPE_CHECKING:
    from bench.lib.ray_fleet import LocalFleet

PARTS = ("overhead", "resume", "throughput", "control_plane")
# the goals the parts check
MAX_ADDED_MS = 2.0  # overhead: what the fleet may add to a verify round ...
MAX_ADDED_PCT = 5.0  # ... or, as a share of ms per token
MIN_LANDED_PCT = 95.0  # resume: resumes on the replica holding their session
MIN_SCALING = 1.7  # throughput: 2 replicas against 1
EDGE_DRAFT = "tiny"  # the resume part's drafter (torch): SmolLM2's vocabulary, as tiny's


def parts_list(text: str) -> list[str]:
    """An argparse type: a comma list of parts (PARTS), in PARTS' order."""
    chosen = {p.strip() for p in text.split(",") if p.strip()}
    unknown = sorted(chosen - set(PARTS))
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"expected some of {','.join(PARTS)}, got {text!r}")
    return [p for p in PARTS if p in chosen]


def _counts(text: str) -> list[int]:
    """An argparse type: a comma list of whole numbers >= 1."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of whole numbers >= 1, got {text!r}")
    return counts


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--parts", type=parts_list, default=",".join(PARTS), help="which parts run (comma list)")
    add_model_args(
        ap,
        model="tiny",
        model_help="target of the verifier and every replica (tiny, smollm2-135m: the resume part's "
        "tiny drafter needs SmolLM2's vocabulary)",
        threads=1,
        threads_help="torch threads of the direct verifier and of each replica (each replica holds as "
        "many Ray CPUs)",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="the direct verifier's and each replica's device (cpu, cuda: a replica then holds a GPU)",
    )
    ap.add_argument(
        "--direct",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the fleet's clients move their sessions to the replicas' own addresses, past Serve's "
        "proxy, which still routes them (cloud-verifier fleet --direct); --no-direct: every frame "
        "through the proxy",
    )
    ap.add_argument("--verify-sessions", type=int, default=10, help="overhead: greedy sessions on each side")
    ap.add_argument("--nodes", type=int, default=8, help="overhead: nodes of each scripted tree")
    ap.add_argument(
        "--frames",
        type=int,
        default=200,
        help="overhead: echo frames per connection, 3 connections (0: none)",
    )
    ap.add_argument("--sessions", type=int, default=40, help="resume: generations, each cut once")
    ap.add_argument("--clients", type=int, default=8, help="throughput: concurrent clients")
    ap.add_argument(
        "--clients-per-replica",
        type=_counts,
        default=None,
        help="throughput: loads of this many concurrent clients per replica (a comma list) instead of "
        "--clients: each fleet at the same loads per replica, its continuous batching as full as the "
        "lone replica's; a fleet's saturation is its best tokens/s over them",
    )
    ap.add_argument(
        "--load",
        choices=["greedy", "ar"],
        default="greedy",
        help="throughput: the clients' sessions: greedy with prompt-lookup trees, or ar",
    )
    ap.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="throughput: confine each replica to --threads cores of its own (as taskset does), so "
        "that one replica is measured on one core's worth, not helped by the idle rest",
    )
    ap.add_argument(
        "--plain",
        action="store_true",
        help="throughput: also the same loads on 1 and 2 `cloud-verifier serve` processes with no Ray "
        "(one core each, clients spread over them): the machine's own scaling, the fleet's ceiling",
    )
    ap.add_argument(
        "--seconds",
        type=float,
        default=30.0,
        help="throughput: measured seconds per fleet; control_plane: seconds sampled",
    )
    ap.add_argument("--warmup", type=float, default=3.0, help="throughput: seconds of load before them")
    add_common_args(
        ap,
        json=True,
        json_help="rows: one per measure of each part; goals, cpus and the resume part's records beside",
        seed=0,
        seed_help="prompts, trees, modes and cut moments",
        tokens=64,
        tokens_help="new tokens per generation (every part)",
        no_progress=True,
    )


# ------------------------------------------------------------------------------ pure figures
def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def compare(what: str, direct: Sequence[float], fleet: Sequence[float]) -> dict[str, Any]:
    """One overhead row: the median and 90th percentile of `direct` and `fleet` (seconds, shown in
    ms) and what the fleet adds to the median, in ms and as % of the direct median."""
    d_med, f_med = median(direct), median(fleet)
    d90, f90 = percentile(direct, 90), percentile(fleet, 90)
    added = None if d_med is None or f_med is None else (f_med - d_med) * 1e3
    pct = None if added is None or not d_med else added / (d_med * 1e3) * 100
    return {
        "part": "overhead",
        "what": what,
        "n": min(len(direct), len(fleet)),
        "direct_median_ms": _ms(d_med),
        "direct_p90_ms": _ms(d90),
        "fleet_median_ms": _ms(f_med),
        "fleet_p90_ms": _ms(f90),
        "added_ms": None if added is None else round(added, 3),
        "added_pct": None if pct is None else round(pct, 1),
    }


def overhead_goal(round_row: Mapping[str, Any], per_token_row: Mapping[str, Any]) -> dict[str, Any]:
    """The overhead goal: the fleet adds at most MAX_ADDED_MS to a verify round (median), or at most
    MAX_ADDED_PCT % to ms per token."""
    added, pct = round_row["added_ms"], per_token_row["added_pct"]
    met = (added is not None and added <= MAX_ADDED_MS) or (pct is not None and pct <= MAX_ADDED_PCT)
    return {
        "goal": f"adds <= {MAX_ADDED_MS:g} ms to a round or <= {MAX_ADDED_PCT:g} % of ms/token",
        "added_ms": added,
        "added_pct_of_ms_per_token": pct,
        "met": met,
    }


def landed(kv: Mapping[str, float]) -> dict[str, Any]:
    """Where resumes landed, from `cloud_verifier_resumes_total` by `kv` summed over replicas:
    `reused` and `busy` on the replica holding the session, `gone` on another (or after it
    expired); the share that landed, in %, and the goal (MIN_LANDED_PCT)."""
    counts = {k: int(kv.get(k, 0.0)) for k in ("reused", "busy", "gone")}
    total = sum(counts.values())
    share = round((counts["reused"] + counts["busy"]) / total * 100, 1) if total else None
    return {
        **counts,
        "server_resumes": total,
        "landed_pct": share,
        "met": share is not None and share >= MIN_LANDED_PCT,
    }


def scaling(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Saturation tokens/s (the best over the loads tried) of the largest fleet over the one-replica
    fleet's, and the goal (MIN_SCALING); the fleet's rows only (`system` "ray" or absent)."""
    by: dict[int, float] = {}
    for r in rows:
        if r.get("system", "ray") == "ray":
            by[r["replicas"]] = max(by.get(r["replicas"], 0.0), r["tokens_per_s"])
    one, most = by.get(1), by.get(max(by)) if by else None
    ratio = round(most / one, 2) if one and most is not None and max(by) > 1 else None
    return {"ratio": ratio, "goal": f">= {MIN_SCALING:g}x", "met": ratio is not None and ratio >= MIN_SCALING}


# ------------------------------------------------------------------------------ the flags both run
def serve_flags(a: argparse.Namespace) -> list[str]:
    """`cloud-verifier serve` flags of the direct verifier and of every replica, past --model and
    --threads."""
    return [
        "--device",
        a.device,
        "--no-measure-cost",
        "--kv-blocks",
        "2048",
        "--max-context",
        str(max(512, a.tokens + 128)),
        "--max-sessions",
        str(max(8, a.clients, 2 * max(a.clients_per_replica or [0]))),
    ]


def fleet_flags(a: argparse.Namespace) -> list[str]:
    own = ["--direct", "--direct-host", "127.0.0.1"] if a.direct else ["--no-direct"]
    return ["--model", a.model, "--threads", str(a.threads), *serve_flags(a), *own, "--log-level", "warning"]


# ------------------------------------------------------------------------------ overhead
def overhead(
    a: argparse.Namespace, fleet: LocalFleet, fp: str, vocab: int
) -> tuple[list[dict[str, Any]], bool]:
    """The overhead part's rows and whether the fleet generated the direct verifier's tokens."""
    from bench.lib.echo import echo_process, echo_rounds
    from bench.lib.raw_sessions import ar_tokens, random_prompt, timed_greedy

    rng = random.Random(a.seed)
    prompts = [random_prompt(rng, 12, vocab) for _ in range(a.verify_sessions + 1)]  # [0]: warm-up
    rounds: dict[str, list[float]] = {"direct": [], "fleet": []}
    firsts: dict[str, list[float]] = {"direct": [], "fleet": []}
    per_token: dict[str, list[float]] = {"direct": [], "fleet": []}
    opening: dict[str, list[float]] = {"direct": [], "fleet": []}
    outs: dict[str, list[list[int]]] = {"direct": [], "fleet": []}
    echo: dict[str, tuple[list[float], list[float], list[float]]] = {
        "direct": ([], [], []),
        "fleet": ([], [], []),
    }
    reps = 3 if a.frames > 5 else 0
    bar = tqdm(
        total=2 * len(prompts) + 2 * reps, desc="fleet overhead", file=sys.stderr, disable=a.no_progress
    )
    with Verifier(a.model, threads=a.threads, args=serve_flags(a)) as direct, contextlib.ExitStack() as stack:
        fleet.deploy(fleet_flags(a), 1)
        urls = {"direct": direct.url, "fleet": fleet.url}
        for i, prompt in enumerate(prompts):
            ref = ar_tokens(direct.url, fp, prompt, a.tokens)
            sides = ["direct", "fleet"] if i % 2 else ["fleet", "direct"]  # each goes first in turn
            for side in sides:
                out, times, opened = timed_greedy(
                    urls[side],
                    fp,
                    prompt,
                    ref,
                    a.tokens,
                    a.seed + i,
                    vocab,
                    a.nodes,
                    direct=side == "fleet" and a.direct,
                )
                bar.update()
                if i == 0:
                    continue  # warm-up: each side's first session
                outs[side].append(out)
                firsts[side].append(times[0])
                rounds[side].extend(times[1:])
                per_token[side].append(sum(times) / max(1, len(out)))
                opening[side].append(opened)
        if reps:
            bases = {"direct": stack.enter_context(echo_process()), "fleet": fleet.deploy_echo()}
            for rep in range(reps):
                for side in ["direct", "fleet"] if rep % 2 else ["fleet", "direct"]:
                    opened, rtts, gets = echo_rounds(bases[side], a.frames)
                    echo[side][0].append(opened)
                    echo[side][1].extend(rtts)
                    echo[side][2].extend(gets)
                    bar.update()
            fleet.delete("echo")
    bar.close()
    rows = [
        compare("verify round", rounds["direct"], rounds["fleet"]),
        compare("prompt round", firsts["direct"], firsts["fleet"]),
        compare("ms per token", per_token["direct"], per_token["fleet"]),
        compare("session opening", opening["direct"], opening["fleet"]),
    ]
    if reps:
        rows += [
            compare("echo: frame round trip", echo["direct"][1], echo["fleet"][1]),
            compare("echo: connect", echo["direct"][0], echo["fleet"][0]),
            compare("echo: GET /healthz", echo["direct"][2], echo["fleet"][2]),
        ]
    return rows, outs["direct"] == outs["fleet"]


# ------------------------------------------------------------------------------ resume
async def _edge_generation(
    url: str, drafter: Any, prompt: list[int], kw: dict[str, Any], tokens: int, cut_at: int | None
) -> tuple[list[int], list[float], int, bool]:
    """One edge generation through the fleet, its connection aborted (no closing handshake) at
    verdict `cut_at` unless that verdict ends it: (its tokens, its resumes' seconds, its verdicts,
    whether it was cut)."""
    from edge_client.client import EdgeClient, ResumeConfig
    from shared.messages import Verdict

    c = EdgeClient(url, drafter, resume=ResumeConfig(backoff_s=0.05))
    seen = 0
    cut = False

    def on_verdict(v: Verdict, prespeculated: bool) -> None:
        nonlocal seen, cut
        seen += 1
        if seen == cut_at and not v.done:
            transport: Any = c.session._transport  # the live WebSocket's TCP transport
            transport._ws.transport.abort()
            cut = True

    async for _ in c.generate(prompt, max_new_tokens=tokens, raw=True, on_verdict=on_verdict, **kw):
        pass
    assert c.last is not None
    out = list(c.last.tokens)
    resumes = list(c.resumes)
    await c.close()
    return out, resumes, seen, cut


def resume(
    a: argparse.Namespace, fleet: LocalFleet, vocab: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The resume part's figures and each generation's record (bench.robustness.chaos.record, with
    its cut)."""
    from bench.lib.raw_sessions import random_prompt
    from bench.robustness.lost_tokens import record
    from edge_client.drafters.registry import create_drafter

    rng = random.Random(a.seed)
    fleet.deploy(fleet_flags(a), 2)
    before = fleet.totals("cloud_verifier_resumes", "kv")
    drafter = create_drafter("torch", EDGE_DRAFT, n_threads=1)  # the edge takes one core of the replicas
    records: list[dict[str, Any]] = []
    try:
        for _ in tqdm(range(a.sessions), desc="fleet resumes", file=sys.stderr, disable=a.no_progress):
            prompt = random_prompt(rng, rng.randint(4, 24), vocab)
            mode = rng.choice(["greedy", "match"])
            kw = {"mode": mode, "temperature": 0.8 if mode == "match" else 0.0, "seed": rng.randrange(2**31)}
            want, _, verdicts, _ = asyncio.run(
                _edge_generation(fleet.url, drafter, prompt, kw, a.tokens, None)
            )
            cut_at = rng.randint(1, max(1, verdicts - 1))  # before the last verdict
            got, resumes, _, cut = asyncio.run(
                _edge_generation(fleet.url, drafter, prompt, kw, a.tokens, cut_at)
            )
            records.append({**record(mode, want, got, resumes), "cut_at": cut_at, "cut": cut})
    finally:
        drafter.close()
    client_resumes = sum(r["resumes"] for r in records)
    after = fleet.totals("cloud_verifier_resumes", "kv", at_least=sum(before.values()) + client_resumes)
    kv = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    figures = {
        "part": "resume",
        "sessions": len(records),
        "cut": sum(r["cut"] for r in records),
        "client_resumes": client_resumes,
        **landed(kv),
        "identical": all(r["identical"] for r in records),
        "tokens_lost": sum(r["tokens_lost"] for r in records),
        "tokens_repeated": sum(r["tokens_repeated"] for r in records),
        "resume_ms_median": median([ms for r in records for ms in r["resume_ms"]], 1),
    }
    return figures, records


# ------------------------------------------------------------------------------ the run
def vocabulary(model: str) -> tuple[str, int]:
    """The vocabulary fingerprint a hello to a verifier of `model` names, and the vocabulary's size
    (from its tokenizer; the weights are not loaded here)."""
    from bench.serving.load_clients import load_tokenizer
    from shared.vocab import vocab_fingerprint

    texts = load_tokenizer(model).token_texts()
    return vocab_fingerprint(texts), len(texts)


def _signed(x: float | None) -> str:
    return "?" if x is None else f"{x:+g}"


def goal_line(part: str, goal: Mapping[str, Any], cpus: int) -> str:
    """The line under a part's table: its goal, met or not (throughput: and the machine's cores)."""
    verdict = "met" if goal["met"] else "NOT met"
    if part == "control_plane":
        return (
            f"the cluster's own processes: {goal['cluster_pct']} % of a core beside 2 idle replicas "
            f"(no goal; {cpus} CPUs here)"
        )
    if part == "overhead":
        return (
            f"goal: the fleet {goal['goal']}: {verdict} ({_signed(goal['added_ms'])} ms a round, "
            f"{_signed(goal['added_pct_of_ms_per_token'])} % ms/token)"
        )
    if part == "resume":
        held = f"{goal['landed_pct']} %"
        return (
            f"goal: >= {MIN_LANDED_PCT:g} % of resumes on the replica holding the session: {held}, {verdict}"
        )
    plain = goal.get("plain_ratio")
    ceiling = f"; 2 plain verifiers (no Ray) give {plain}x of 1 here" if plain is not None else ""
    return (
        f"goal: 2 replicas {goal['goal']} the tokens/s of 1: {goal['ratio']}x, {verdict}{ceiling}\n"
        f"{cpus} CPUs here: the load client, Serve's proxy and Ray's own processes share them with "
        "the replicas" + (" (on 2 cores, 2 replicas of 1 thread leave no core to them)" if cpus <= 2 else "")
    )


def render(rows: Sequence[Mapping[str, Any]], goals: Mapping[str, Mapping[str, Any]], cpus: int) -> str:
    """The printed tables, one per part run, each with its goal under it."""
    out = []
    for part in PARTS:
        mine = [r for r in rows if r["part"] == part]
        if not mine:
            continue
        if part == "resume":
            figures = [[k, v] for k, v in mine[0].items() if k not in ("part", "met")]
            body = table(figures, ["figure", "value"])
        else:
            header = [k for k in mine[0] if k != "part"]
            body = table([[r[k] for k in header] for r in mine], header)
        out.append(f"{part}:\n{body}\n{goal_line(part, goals[part], cpus)}")
    return "\n\n".join(out)


def run(a: argparse.Namespace) -> Result:
    if min(a.verify_sessions, a.sessions, a.clients, a.nodes, a.threads) < 1 or a.tokens < 8:
        raise UsageError(
            "--verify-sessions, --sessions, --clients, --nodes, --threads >= 1 and --tokens >= 8"
        )
    if a.seconds <= 0 or a.warmup < 0 or a.frames < 0:
        raise UsageError("--seconds > 0, --warmup >= 0 and --frames >= 0")
    from bench.lib.ray_fleet import LocalFleet, ray_missing

    why = ray_missing()
    if why:
        raise UsageError(why)
    fp, vocab = vocabulary(a.model)
    cpus = cpu_count()
    rows: list[dict[str, Any]] = []
    goals: dict[str, dict[str, Any]] = {}
    records: list[dict[str, Any]] = []
    same = True
    with LocalFleet(num_cpus=2 * a.threads) as fleet:
        if "overhead" in a.parts:
            part_rows, same = overhead(a, fleet, fp, vocab)
            rows += part_rows
            goals["overhead"] = overhead_goal(part_rows[0], part_rows[2])
        if "resume" in a.parts:
            figures, records = resume(a, fleet, vocab)
            rows.append(figures)
            goals["resume"] = {"goal": f">= {MIN_LANDED_PCT:g} % landed", "landed_pct": figures["landed_pct"],
                               "met": figures["met"]}  # fmt: skip
        if "throughput" in a.parts:
            part_rows = throughput(a, fleet, fp, vocab, fleet_flags(a))
            rows += part_rows
            goals["throughput"] = scaling(part_rows)
        if "control_plane" in a.parts:
            part_rows = control_plane(a, fleet, fleet_flags(a))
            rows += part_rows
            goals["control_plane"] = {"cluster_pct": part_rows[-1]["cpu_pct"], "met": True}
    if "throughput" in a.parts and a.plain:
        plain = plain_throughput(a, fp, vocab, serve_flags(a))
        rows += plain
        goals["throughput"]["plain_ratio"] = scaling([{**r, "system": "ray"} for r in plain])["ratio"]
    identical = same and all(r["identical"] for r in records)
    text = render(rows, goals, cpus)
    if not same:
        text += "\nthe fleet's greedy tokens differ from the direct verifier's"
    return Result(
        rows,
        text,
        extra={
            "goals": goals,
            "cpus": cpus,
            "direct": a.direct,
            "fleet_tokens_identical": same,
            "records": records,
        },
        status=0 if identical else 1,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
