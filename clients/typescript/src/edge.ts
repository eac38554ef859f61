// The edge SDK in one object: a session with the verifier, the draft model of an ONNX export and its
// tokenizer. Text in, text out:
//
//   import * as ort from "onnxruntime-node";   // or onnxruntime-web in a browser
//   const edge = await Edge.open("ws://host:8000/v1/session", await folderReader("smollm2-onnx"), ort);
//   for await (const text of edge.generate("Write a haiku", { maxNewTokens: 64, signal })) show(text);
//   console.log(edge.last.tau);
import { type GenerateOptions, type ResumeOptions, type Stats, TreespecClient } from "./client.js";
import {
  draftConditional, draftStatic, type DrafterOptions, type ExportReader, type Manifest, OnnxDrafter, type OrtLike, readManifest,
} from "./onnx_drafter.js";  // prettier-ignore
import type { Coupling } from "./coupling.js";
import type { Tree } from "./protocol.js";
import { type ChatMessage, TextCodec } from "./text.js";

/** Coupled drafting for a `match` generation (its seed and sampling settings; `auto`, the default
 * mode, verifies match at temperature > 0); none otherwise. */
export function couplingOf(o: { mode?: string; temperature?: number; seed?: bigint | number; topK?: number; topP?: number }): Coupling | undefined {
  const mode = o.mode ?? "auto";
  if (!(mode === "match" || mode === "auto") || !((o.temperature ?? 0) > 0)) return undefined;
  return { seed: o.seed ?? 0, temperature: o.temperature!, topK: o.topK ?? 0, topP: o.topP ?? 1 };
}

export const DEFAULT_TREE = [1, 1, 3, 1, 1, 1, 1, 1]; // SpecInfer's default expansion

export interface EdgeOptions extends DrafterOptions {
  apiKey?: string;
  resume?: Partial<ResumeOptions> | false; // reconnect after a drop and go on (default: 10 attempts)
  prespec?: boolean; // pre-speculate each round's likeliest outcome (default false; mode auto always does)
  tree?: number[]; // the expansion tree drafted each round
  where?: string; // how errors name the export (default "the export")
  // open as soon as the verifier answers and load the draft model meanwhile: until it is loaded each
  // round is the target's own token (an empty tree, `Stats.cloudRounds`), so the first tokens do not
  // wait for the model (default false: open returns with the model loaded; `edge.ready` either way)
  background?: boolean;
}

/** A text (chat template unless `raw`), chat messages, or token ids. */
export type Prompt = string | ChatMessage[] | readonly number[];

export interface TextOptions extends Omit<GenerateOptions, "draft" | "lookup" | "prespec"> {
  prespec?: boolean; // this generation pre-speculates (default: EdgeOptions.prespec)
  raw?: boolean; // the prompt as is, without the chat template
}

/** A tree of no nodes after `ctx`: the verifier answers it with the target's own next token. */
export const cloudRound = (ctx: readonly number[]): Tree => ({ base: ctx.length, cond: [], tokens: [], parents: [] });

export class Edge {
  private loaded: OnnxDrafter | null = null;
  private failed: Error | null = null;
  /** Resolves with the draft model once it is loaded (rejects with why it could not be). */
  readonly ready: Promise<OnnxDrafter>;

  private constructor(
    readonly client: TreespecClient,
    readonly manifest: Manifest,
    loading: Promise<OnnxDrafter>,
    readonly codec: TextCodec,
    private readonly tree: number[],
    private readonly prespec: boolean,
  ) {
    this.ready = loading.then(
      (d) => (this.loaded = d),
      (e: Error) => {
        this.failed = e;
        throw e;
      },
    );
    this.ready.catch(() => undefined); // surfaced by `ready` and by the next draft, never unhandled
  }

  /**
   * Read the export's manifest and tokenizer (checked), connect and check that its vocabulary is the
   * verifier's; the model loads meanwhile. Returns with it loaded unless `background`.
   */
  static async open(server: string | string[], reader: ExportReader, ort: OrtLike, o: EdgeOptions = {}): Promise<Edge> {
    const where = o.where ?? "the export";
    const manifest = await readManifest(reader, where);
    const client = TreespecClient.connect(server, manifest.fingerprint, o.apiKey, { resume: o.resume });
    const codec = TextCodec.load(reader, manifest, where);
    codec.catch(() => undefined); // awaited below (after a failed connect, not at all)
    const loading = OnnxDrafter.load(reader, where, ort, o, manifest);
    loading.catch(() => undefined); // awaited below, or by `ready`
    const edge = new Edge(await client, manifest, loading, await codec, o.tree ?? DEFAULT_TREE, o.prespec ?? false);
    if (!o.background) {
      try {
        await edge.ready;
      } catch (e) {
        edge.close(); // the session is no use without the model
        throw e;
      }
    }
    return edge;
  }

  /** The draft model (an error while it is still loading: await `ready`). */
  get drafter(): OnnxDrafter {
    if (this.loaded) return this.loaded;
    throw this.failed ?? new Error("the draft model is still loading: await edge.ready");
  }

  /** Whether the draft model is loaded (rounds before that are the target's own tokens). */
  get drafting(): boolean {
    return this.loaded !== null;
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
    // until the model is loaded (`background`): an empty tree, the target's own token
    const draft = (ctx: readonly number[]) => {
      if (this.failed) throw this.failed;
      return this.loaded ? draftStatic(this.loaded, ctx, this.tree, coupling) : cloudRound(ctx);
    };
    const prespec = (o.prespec ?? ((o.mode ?? "auto") === "auto" || this.prespec))
      ? async (ctx: readonly number[], t: Tree) => (this.loaded ? draftConditional(this.loaded, ctx, t, this.tree, coupling) : null)
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
