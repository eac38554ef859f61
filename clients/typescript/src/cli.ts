#!/usr/bin/env node
// treespec-ts: generate against a verifier, drafting with an ONNX draft model or by prompt lookup.
//   node dist/src/cli.js --server ws://127.0.0.1:8000/v1/session --fingerprint HEX --prompt-ids 1,2,3
import { parseArgs } from "node:util";
import { type GenerateOptions, GenerationError, type Objective, TreespecClient, type TreeSource } from "./client.js";
import {
  chooseBudget,
  draftConditional,
  draftDynamic,
  draftStatic,
  type DynamicTree,
  ExportError,
  folderReader,
  nextGains,
  OnnxDrafter,
  type OrtLike,
  readManifest,
} from "./onnx_drafter.js";
import { couplingOf } from "./edge.js";
import { TextCodec } from "./text.js";

const HELP = `treespec-ts: a TypeScript client of the treespec verifier (PROTOCOL.md)

  treespec-ts generate --server URL --draft EXPORT_DIR [options] [--raw] PROMPT
      draft with the ONNX export in EXPORT_DIR (edge-client export-onnx), run by onnxruntime-node;
      PROMPT is text (a chat prompt unless --raw), tokenized with the export's tokenizer, and the
      answer streams as text (or give --prompt-ids A,B,... and get ids)
  treespec-ts [options] --fingerprint HEX --prompt-ids A,B,...
      draft by prompt lookup (no model)

  --server URL          ws:// or wss:// URL of the session endpoint (default ws://127.0.0.1:8000/v1/session)
  --draft DIR           generate: the draft model's ONNX export folder (its manifest gives the fingerprint)
  --tree K1,K2,...      generate: SpecInfer's expansion tree, children per level (default 1,1,3,1,1,1,1,1)
  --budget N|auto       generate: a best-first tree of N nodes instead (auto: sized each round from the
                        verifier's cost curve, the drafter's measured speed and the round trip)
  --threads N           generate: the draft model's threads (default 1)
  --fingerprint HEX     sha256 fingerprint of the target's vocabulary (PROTOCOL.md section 8)
  --prompt-ids A,B,...  the prompt as token ids (tokenize with the model the verifier names)
  --raw                 generate: send PROMPT as is, without the chat template
  --mode M              auto (default), greedy, match (sampled, exact) or ar (target only). auto verifies
                        greedy (match at --temperature > 0) and plans each round: it speculates (pre-
                        speculating with a draft model), keeps a stream waiting behind each tree in
                        flight so a miss never idles the verifier, and after a miss lets the target
                        stream where that is faster than speculating (a verifier without round.stream:
                        it speculates as greedy / match do)
  --objective O         auto: latency (default: the fewest ms per token for the user) or cost (the
                        fewest verifier ms per token, no slower than ar by more than 1.25x)
  --max-new-tokens N    default 64
  --temperature T       match: sampling temperature (> 0)
  --seed S              match: the seed of the keyed sampler
  --no-couple           match: draft the draft's likeliest tokens, not the keyed (coupled) token first
  --prespec             generate: while a tree is verified, draft the tree after its likeliest outcome
                        and send it conditional on it (the server goes on without waiting when it holds);
                        always on in --mode auto
  --depth D --width W   prompt lookup: tokens per guess, guesses merged into the tree
  --api-key KEY         if the verifier needs one
  --json                print one JSON object (text, prompt_tokens, tokens, stats with tau) at the end
  --cancel-after N      abort the generation (AbortSignal) once N tokens have arrived; the tokens
                        committed until the server's cancelled verdict are kept ("cancelled": true)
`;

function ints(text: string, what: string): number[] | string {
  const xs = text.split(",").map((x) => Number(x));
  if (xs.some((x) => !Number.isInteger(x) || x < 0)) return `${what} takes comma-separated non-negative integers`;
  return xs;
}

/** `treespec-ts tokenize --draft DIR`: stdin a JSON list of {"text", "raw"}, stdout their ids (a
 * JSON list of lists): the export's tokenizer as generate uses it, for comparing with Python's. */
async function tokenize(argv: string[]): Promise<number> {
  const { values: a } = parseArgs({ args: argv, options: { draft: { type: "string" } } });
  if (!a.draft) {
    process.stderr.write("treespec-ts: tokenize needs --draft EXPORT_DIR\n");
    return 2;
  }
  const reader = await folderReader(a.draft);
  const codec = await TextCodec.load(reader, await readManifest(reader, a.draft), a.draft);
  const chunks: Buffer[] = [];
  for await (const c of process.stdin) chunks.push(c as Buffer);
  const items = JSON.parse(Buffer.concat(chunks).toString("utf8")) as { text: string; raw?: boolean }[];
  process.stdout.write(JSON.stringify(items.map((x) => codec.encodePrompt(x.text, x.raw ?? false))) + "\n");
  return 0;
}

async function main(): Promise<number> {
  const argv = process.argv.slice(2);
  if (argv[0] === "tokenize") return tokenize(argv.slice(1));
  const generate = argv[0] === "generate";
  const { values: a, positionals } = parseArgs({
    args: generate ? argv.slice(1) : argv,
    allowPositionals: generate,
    options: {
      raw: { type: "boolean", default: false }, budget: { type: "string" }, "cancel-after": { type: "string", default: "0" },
      server: { type: "string", default: "ws://127.0.0.1:8000/v1/session" }, draft: { type: "string" },
      tree: { type: "string", default: "1,1,3,1,1,1,1,1" }, threads: { type: "string", default: "1" },
      fingerprint: { type: "string" }, "prompt-ids": { type: "string" }, mode: { type: "string", default: "auto" },
      objective: { type: "string", default: "latency" },
      "max-new-tokens": { type: "string", default: "64" }, temperature: { type: "string", default: "0" },
      seed: { type: "string", default: "0" }, depth: { type: "string", default: "8" }, width: { type: "string", default: "3" },
      "api-key": { type: "string" }, json: { type: "boolean", default: false }, help: { type: "boolean", default: false },
      "no-couple": { type: "boolean", default: false }, prespec: { type: "boolean", default: false },
    },  // prettier-ignore
  });
  const usage = (why: string) => {
    process.stderr.write(`treespec-ts: ${why}\n`);
    return 2;
  };
  if (a.help) {
    process.stdout.write(HELP);
    return 0;
  }
  if (generate ? !a.draft : !a.fingerprint) {
    process.stdout.write(HELP);
    return usage(generate ? "generate needs --draft EXPORT_DIR" : "--fingerprint is required without generate");
  }
  const text = positionals.join(" ");
  if (!a["prompt-ids"] && !text) return usage(generate ? "give a PROMPT (or --prompt-ids A,B,...)" : "--prompt-ids A,B,... is required");
  if (a["prompt-ids"] && text) return usage("give a PROMPT or --prompt-ids, not both");
  const mode = a.mode as "auto" | "greedy" | "match" | "ar";
  if (!["auto", "greedy", "match", "ar"].includes(mode)) return usage(`--mode must be auto, greedy, match or ar, got ${a.mode}`);
  const objective = a.objective as Objective;
  if (!["latency", "cost"].includes(objective)) return usage(`--objective must be latency or cost, got ${a.objective}`);
  let ids = a["prompt-ids"] ? ints(a["prompt-ids"], "--prompt-ids") : [];
  const ks = ints(a.tree!, "--tree");
  if (typeof ids === "string") return usage(ids);
  if (typeof ks === "string" || ks.some((k) => k < 1)) return usage("--tree takes comma-separated positive integers");
  try {
    let fingerprint = a.fingerprint!;
    let draft: TreeSource | undefined;
    let prespec: GenerateOptions["prespec"];
    let client: TreespecClient | undefined;
    let codec: TextCodec | undefined;
    if (generate) {
      const ort = (await import("onnxruntime-node")) as unknown as OrtLike;
      const reader = await folderReader(a.draft!);
      const drafter = await OnnxDrafter.load(reader, a.draft!, ort, { threads: Number(a.threads) });
      fingerprint = drafter.manifest.fingerprint;
      // auto verifies match at temperature > 0 (greedy at 0): couple its drafting as match's
      const verified = mode === "auto" ? (Number(a.temperature) > 0 ? "match" : "greedy") : mode;
      const coupling = a["no-couple"] ? undefined : couplingOf({ mode: verified, temperature: Number(a.temperature), seed: BigInt(a.seed!) });
      draft = (ctx) => draftStatic(drafter, ctx, ks, coupling);
      if (a.prespec || mode === "auto") prespec = (ctx, t) => draftConditional(drafter, ctx, t, ks, coupling);
      if (a.budget !== undefined) {
        const fixed = a.budget === "auto" ? 0 : Number(a.budget);
        if (!(a.budget === "auto" || (Number.isInteger(fixed) && fixed >= 1))) {
          return usage(`--budget takes a positive number of nodes or auto, got ${a.budget}`);
        }
        let last: DynamicTree | null = null;
        draft = async (ctx) => {
          const lim = client!.welcome.limits;
          const cap = Math.min(lim.max_nodes, drafter.maxNodes);
          const n = fixed || chooseBudget(client!.welcome.verify_cost_ms, nextGains(last, cap), {
            rttMs: client!.rttMs, draftMsPerNode: drafter.msPerRow, maxNodes: cap,
          });  // prettier-ignore
          last = await draftDynamic(drafter, ctx, Math.min(n, cap), { maxDepth: lim.max_depth });
          return last.tree;
        };
      }
      if (text) {
        codec = await TextCodec.load(reader, drafter.manifest, a.draft!);
        ids = codec.encodePrompt(text, a.raw);
      }
    }
    const c = await TreespecClient.connect(a.server!, fingerprint, a["api-key"]);
    client = c;
    const out: number[] = [];
    const shown = codec?.stream();
    const abort = new AbortController();
    const cancelAfter = Number(a["cancel-after"]);
    let cancelled = false;
    try {
    for await (const chunk of c.generate(ids as number[], {
      mode, objective, maxNewTokens: Number(a["max-new-tokens"]), temperature: Number(a.temperature), seed: BigInt(a.seed!),
      lookup: { depth: Number(a.depth), width: Number(a.width) }, draft, prespec, signal: abort.signal,
    })) {  // prettier-ignore
      out.push(...chunk);
      if (!a.json) process.stdout.write(shown ? shown(chunk) : chunk.join(" ") + " ");
      if (cancelAfter > 0 && out.length >= cancelAfter) abort.abort();
    }
    } catch (e) {
      if (!(e instanceof DOMException && e.name === "AbortError")) throw e;
      cancelled = true;
    }
    c.close();
    if (a.json) {
      const doc = { text: codec?.decode(out), prompt_tokens: ids, tokens: out, stats: c.last, model: c.welcome.model_id,
                    cancelled };  // prettier-ignore
      process.stdout.write(JSON.stringify(doc) + "\n");
    } else process.stdout.write("\n");
    return 0;
  } catch (e) {
    if (e instanceof GenerationError || e instanceof ExportError) {
      process.stderr.write(`treespec-ts: ${e.message}\n`);
      return 1;
    }
    throw e;
  }
}

// exit once stdout is flushed: a piped stdout is written asynchronously, and exiting at once would
// cut a long JSON line (at 64 KiB)
main().then((rc) => process.stdout.write("", () => process.exit(rc)));
