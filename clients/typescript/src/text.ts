// Text in, text out: the tokenizer stored beside an ONNX export (tokenizer.json, tokens.json and the
// manifest's BOS, end-of-generation ids and chat template), read with @huggingface/tokenizers and
// rendered with @huggingface/jinja: the same token ids as the Python edge (edge_client/client.py)
// for the same prompt, and streamed text that never splits a multi-byte character.
import { Template } from "@huggingface/jinja";
import { Tokenizer } from "@huggingface/tokenizers";
import type { ExportReader, Manifest } from "./onnx_drafter.js";

export interface ChatMessage {
  role: string;
  content: string;
}

export class TextCodec {
  private plainTok: Tokenizer | null = null;

  private constructor(
    private readonly tok: Tokenizer,
    private readonly json: { added_tokens?: { special?: boolean }[] },
    private readonly config: object,
    private readonly texts: string[],
    readonly manifest: Manifest,
  ) {}

  /** A copy that reads special-token texts (e.g. "<|im_end|>") in a raw prompt as plain text, as
   * the Python edge does (`parse_special=False`): the special added tokens left out. */
  private plain(): Tokenizer {
    if (this.plainTok === null) {
      const added = (this.json.added_tokens ?? []).filter((t) => !t.special);
      this.plainTok = new Tokenizer({ ...this.json, added_tokens: added } as object, this.config);
    }
    return this.plainTok;
  }

  /** The tokenizer of an export folder (ExportError-like Error naming the file when it is not there). */
  static async load(reader: ExportReader, manifest: Manifest, where: string): Promise<TextCodec> {
    let json: unknown;
    let texts: unknown;
    try {
      json = JSON.parse(await reader.text("tokenizer.json"));
      texts = JSON.parse(await reader.text("tokens.json"));
    } catch (e) {
      throw new Error(`${where}: no readable tokenizer.json / tokens.json (${(e as Error).message}); re-export`);
    }
    if (!Array.isArray(texts) || texts.length !== manifest.vocab_size) {
      throw new Error(`${where}/tokens.json does not list the manifest's ${manifest.vocab_size} tokens; re-export`);
    }
    const special = (id: number | null) => (id === null || id === undefined ? undefined : (texts as string[])[id]);
    const config = { bos_token: special(manifest.bos_id), eos_token: special(manifest.eos_ids[0] ?? null) };
    const parsed = json as { added_tokens?: { special?: boolean }[] };
    return new TextCodec(new Tokenizer(parsed as object, config), parsed, config, texts as string[], manifest);
  }

  get eosIds(): number[] {
    return this.manifest.eos_ids;
  }

  /** The prompt's ids: a chat prompt under the chat template (special tokens parsed, none added),
   * or raw text as is. */
  encodePrompt(prompt: string | ChatMessage[], raw = false): number[] {
    if (raw) {
      if (typeof prompt !== "string") throw new Error("a raw prompt is a string");
      return this.plain().encode(prompt, { add_special_tokens: true }).ids;
    }
    const messages = typeof prompt === "string" ? [{ role: "user", content: prompt }] : prompt;
    return this.tok.encode(this.renderChat(messages), { add_special_tokens: false }).ids;
  }

  renderChat(messages: ChatMessage[]): string {
    const template = this.manifest.chat_template;
    if (!template) throw new Error("this model has no chat template: pass the prompt raw (--raw)");
    const tokenText = (id: number | null | undefined) => (id === null || id === undefined ? "" : this.texts[id]);
    return new Template(template).render({
      messages,
      add_generation_prompt: true,
      bos_token: tokenText(this.manifest.bos_id),
      eos_token: tokenText(this.manifest.eos_ids[0]),
    });
  }

  /** The text of output ids (special tokens left out). */
  decode(ids: readonly number[]): string {
    return this.tok.decode([...ids], { skip_special_tokens: true });
  }

  /** A streaming decoder: feed each verdict's tokens, get the text that is complete so far. */
  stream(): (ids: readonly number[]) => string {
    const all: number[] = [];
    let shown = 0;
    return (ids) => {
      all.push(...ids);
      const text = this.decode(all);
      // hold back a trailing replacement character: a multi-byte character still being spelled
      const end = text.endsWith("\uFFFD") ? text.replace(/\uFFFD+$/, "").length : text.length;
      const out = end > shown ? text.slice(shown, end) : "";
      shown = Math.max(shown, end);
      return out;
    };
  }
}
