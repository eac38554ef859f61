// The frames of the connection in use, in order, for a client that awaits them one at a time.
import { decodeMessage, type Message } from "./protocol.js";
import { GenerationError } from "./errors.js";

export class Inbox {
  private items: (Message | Error)[] = [];
  private waiting: ((m: Message | Error) => void) | null = null;

  /** Forget what is queued (a new connection). */
  reset(): void {
    this.items = [];
    this.waiting = null;
  }

  /** A frame off the socket (null: a text frame, which the protocol never sends). */
  received(data: Uint8Array | null): void {
    let m: Message | Error;
    try {
      m = data !== null ? decodeMessage(data) : new GenerationError("the verifier sent a text frame");
    } catch (e) {
      m = e as Error;
    }
    this.push(m);
  }

  /** A message, or the error that ends the connection. */
  push(m: Message | Error): void {
    if (this.waiting) {
      const w = this.waiting;
      this.waiting = null;
      w(m);
    } else this.items.push(m);
  }

  /** The next message; an error (or a fatal error frame) is thrown. */
  next(): Promise<Message> {
    const m = this.items.shift();
    const done = (x: Message | Error): Message => {
      if (x instanceof Error) throw x;
      if (x.type === "error" && x.fatal) throw new GenerationError(`verifier refused: ${x.code} (${x.field}): ${x.message}`, x.code, x.field);
      return x;
    };  // prettier-ignore
    if (m !== undefined) return Promise.resolve(m).then(done);
    return new Promise((resolve, reject) => {
      this.waiting = (x) => {
        try {
          resolve(done(x));
        } catch (e) {
          reject(e);
        }
      };
    });
  }
}
