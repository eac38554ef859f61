#!/usr/bin/env node
// treespec-ts: generate against a verifier with the prompt-lookup drafter; token ids in and out.
//   node dist/src/cli.js --server ws://127.0.0.1:8000/v1/session --fingerprint HEX --prompt-ids 1,2,3
import { parseArgs } from "node:util";
import { GenerationError, TreespecClient } from "./client.js";

const HELP = `treespec-ts: a TypeScript client of the treespec verifier (PROTOCOL.md)

  --server URL          ws:// or wss:// URL of the session endpoint (default ws://127.0.0.1:8000/v1/session)
  --fingerprint HEX     sha256 fingerprint of the target's vocabulary (PROTOCOL.md section 8)
  --prompt-ids A,B,...  the prompt as token ids (tokenize with the model the verifier names)
  --mode M              greedy (default), match (sampled, exact) or ar (target only)
  --max-new-tokens N    default 64
  --temperature T       match: sampling temperature (> 0)
  --seed S              match: the seed of the keyed sampler
  --depth D --width W   prompt lookup: tokens per guess, guesses merged into the tree
  --api-key KEY         if the verifier needs one
  --json                print {"tokens": [...], "stats": {...}} instead of ids as they come
`;

async function main(): Promise<number> {
  const { values: a } = parseArgs({
    options: {
      server: { type: "string", default: "ws://127.0.0.1:8000/v1/session" },
      fingerprint: { type: "string" }, "prompt-ids": { type: "string" }, mode: { type: "string", default: "greedy" },
      "max-new-tokens": { type: "string", default: "64" }, temperature: { type: "string", default: "0" },
      seed: { type: "string", default: "0" }, depth: { type: "string", default: "8" }, width: { type: "string", default: "3" },
      "api-key": { type: "string" }, json: { type: "boolean", default: false }, help: { type: "boolean", default: false },
    },  // prettier-ignore
  });
  if (a.help || !a.fingerprint || !a["prompt-ids"]) {
    process.stdout.write(HELP);
    return a.help ? 0 : 2;
  }
  const mode = a.mode as "greedy" | "match" | "ar";
  if (!["greedy", "match", "ar"].includes(mode)) {
    process.stderr.write(`treespec-ts: --mode must be greedy, match or ar, got ${a.mode}\n`);
    return 2;
  }
  const ids = a["prompt-ids"].split(",").map((x) => Number(x));
  if (ids.some((x) => !Number.isInteger(x) || x < 0)) {
    process.stderr.write("treespec-ts: --prompt-ids takes comma-separated non-negative integers\n");
    return 2;
  }
  try {
    const c = await TreespecClient.connect(a.server!, a.fingerprint, a["api-key"]);
    const out: number[] = [];
    for await (const chunk of c.generate(ids, {
      mode, maxNewTokens: Number(a["max-new-tokens"]), temperature: Number(a.temperature), seed: BigInt(a.seed!),
      lookup: { depth: Number(a.depth), width: Number(a.width) },
    })) {  // prettier-ignore
      out.push(...chunk);
      if (!a.json) process.stdout.write(chunk.join(" ") + " ");
    }
    c.close();
    if (a.json) process.stdout.write(JSON.stringify({ tokens: out, stats: c.last, model: c.welcome.model_id }) + "\n");
    else process.stdout.write("\n");
    return 0;
  } catch (e) {
    if (e instanceof GenerationError) {
      process.stderr.write(`treespec-ts: ${e.message}\n`);
      return 1;
    }
    throw e;
  }
}

main().then((rc) => process.exit(rc));
