// The edge SDK in one object: a session with the verifier, the draft model of an ONNX export and its
// tokenizer. Text in, text out:
//
//   import * as ort from "onnxruntime-node";   // or onnxruntime-web in a browser
//   const edge = await Edge.open("ws://host:8000/v1/session", await folderReader("smollm2-onnx"), ort);
//   for await (const text of edge.generate("Write a haiku", { maxNewTokens: 64, signal })) show(text);
//   console.log(edge.last.tau);
import { type GenerateOptions, type ResumeOptions, type Stats, TreespecClient } from "./client.js";
import { draftConditional, draftStatic, type DrafterOptions, type ExportReader, OnnxDrafter, type OrtLike } from "./onnx_drafter.js";
import type { Coupling } from "./coupling.js";
import type { Tree } from "./protocol.js";
import { type ChatMessage, TextCodec } from "./text.js";

/** Coupled drafting for a `match` generation (its seed and sampling settings); none otherwise. */
export function couplingOf(o: { mode?: string; temperature?: number; seed?: bigint | number; topK?: number; topP?: number }): Coupling | undefined {
  if (o.mode !== "match" || !((o.temperature ?? 0) > 0)) return undefined;
  return { seed: o.seed ?? 0, temperature: o.temperature!, topK: o.topK ?? 0, topP: o.topP ?? 1 };
}

export const DEFAULT_TREE = [1, 1, 3, 1, 1, 1, 1, 1]; // SpecInfer's default expansion

export interface EdgeOptions extends DrafterOptions {
  apiKey?: string;
  resume?: Partial<ResumeOptions> | false; // reconnect after a drop and go on (default: 10 attempts)
  prespec?: boolean; // pre-speculate each round's likeliest outcome (default false)
  tree?: number[]; // the expansion tree drafted each round
  where?: string; // how errors name the export (default "the export")
}

/** A text (chat template unless `raw`), chat messages, or token ids. */
export type Prompt = string | ChatMessage[] | readonly number[];

export interface TextOptions extends Omit<GenerateOptions, "draft" | "lookup" | "prespec"> {
  prespec?: boolean; // this generation pre-speculates (default: EdgeOptions.prespec)
  raw?: boolean; // the prompt as is, without the chat template
}

export class Edge {
  private constructor(
    readonly client: TreespecClient,
    readonly drafter: OnnxDrafter,
    readonly codec: TextCodec,
    private readonly tree: number[],
    private readonly prespec: boolean,
  ) {}

  /** Load the export (checked), connect, and check that its vocabulary is the verifier's. */
  static async open(server: string | string[], reader: ExportReader, ort: OrtLike, o: EdgeOptions = {}): Promise<Edge> {
    const where = o.where ?? "the export";
    const drafter = await OnnxDrafter.load(reader, where, ort, o);
    const codec = await TextCodec.load(reader, drafter.manifest, where);
    const client = await TreespecClient.connect(server, drafter.manifest.fingerprint, o.apiKey, { resume: o.resume });
    return new Edge(client, drafter, codec, o.tree ?? DEFAULT_TREE, o.prespec ?? false);
  }

  /** The prompt's token ids (chat template unless raw; token ids as they are). */
  encode(prompt: Prompt, raw = false): number[] {
    if (Array.isArray(prompt) && prompt.every((x) => typeof x === "number")) return [...(prompt as readonly number[])];
    return this.codec.encodePrompt(prompt as string | ChatMessage[], raw);
  }

  /** Generate from a prompt; yields the answer's text as it is committed (never half a character). */
  async *generate(prompt: Prompt, o: TextOptions = {}): AsyncGenerator<string> {
    const show = this.codec.stream();
    const coupling = couplingOf(o);
    const draft = (ctx: readonly number[]) => draftStatic(this.drafter, ctx, this.tree, coupling);
    const prespec = (o.prespec ?? this.prespec)
      ? (ctx: readonly number[], t: Tree) => draftConditional(this.drafter, ctx, t, this.tree, coupling)
      : undefined;
    for await (const ids of this.client.generate(this.encode(prompt, o.raw), { ...o, draft, prespec })) {
      const text = show(ids);
      if (text) yield text;
    }
  }

  get last(): Stats {
    return this.client.last;
  }

  close(): void {
    this.client.close();
  }
}
