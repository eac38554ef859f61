// What a generation ends with, and how the client reconnects after a drop (ConnectOptions.resume).

export class GenerationError extends Error {
  constructor(message: string, public code?: string, public field?: string) {
    super(message);
  }
}

/**
 * The connection to the verifier dropped or could not be made (resumed where ConnectOptions.resume
 * allows). `closeCode`: the WebSocket close code that ended it, where one did (1013: try again later).
 */
export class ConnectionLost extends GenerationError {
  constructor(message: string, public closeCode?: number) {
    super(message);
  }
}

/** The close code of a verifier at its session cap, or draining: the same request may succeed later. */
export const TRY_AGAIN_LATER = 1013;

/** Reconnecting after a drop (the Python client's ResumeConfig). */
export interface ResumeOptions {
  attempts: number; // connection attempts per drop (the next URL each); also the drops in a row with no new token a generation survives
  backoffMs: number; // the first wait between attempts, doubled up to maxBackoffMs
  maxBackoffMs: number;
}
export const DEFAULT_RESUME: ResumeOptions = { attempts: 10, backoffMs: 200, maxBackoffMs: 5000 };

export interface ConnectOptions {
  resume?: Partial<ResumeOptions> | false; // false: a drop ends the generation with ConnectionLost
}

export const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
/** The wait before retry number `retry` (1: the first). */
export const backoff = (r: ResumeOptions, retry: number) =>
  Math.min(r.backoffMs * 2 ** Math.max(0, Math.min(retry - 1, 60)), r.maxBackoffMs);
