// The WebSocket under a session: the browser's own (WHATWG) in a page or a worker, the `ws` package in
// Node (it can send an Authorization header; a browser cannot, so there the key goes in `hello`).

import { SESSION_HEADER } from "./protocol.js";

/** What the session needs of a socket. */
export interface Socket {
  send(data: Uint8Array): void;
  close(code?: number): void;
  readonly open: boolean;
  /** Whether the key went in a header (Node); else the session sends it in `hello`. */
  readonly keyInHeader: boolean;
}

export interface SocketEvents {
  message(data: Uint8Array | null): void; // null: a text frame, which the protocol never uses
  close(code: number, reason: string): void;
  error(message: string): void;
}

const MAX_FRAME = 1 << 22; // the largest frame the client takes (the server's limit on its own frames)

/** True in a browser (or a worker): a global WebSocket and no Node. */
export function inBrowser(): boolean {
  const g = globalThis as { WebSocket?: unknown; process?: { versions?: { node?: string } } };
  return typeof g.WebSocket === "function" && !g.process?.versions?.node;
}

/** Open a socket to `url`; resolves once it is open, rejects with a message naming the URL. */
export async function openSocket(url: string, apiKey: string | undefined, on: SocketEvents, sessionId?: string): Promise<Socket> {
  return inBrowser() ? openBrowser(url, on) : openNode(url, apiKey, on, sessionId);
}

async function openBrowser(url: string, on: SocketEvents): Promise<Socket> {
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  await new Promise<void>((resolve, reject) => {
    ws.onopen = () => resolve();
    // a browser says nothing of why (an Origin the verifier refuses looks like any other failure)
    ws.onerror = () => reject(new Error(`cannot reach the verifier at ${url} (is it running, and is this page's ` +
      `origin ${String(globalThis.location?.origin)} in its --allowed-origins?)`));  // prettier-ignore
  });
  ws.onmessage = (ev: MessageEvent) => on.message(ev.data instanceof ArrayBuffer ? new Uint8Array(ev.data) : null);
  ws.onclose = (ev: CloseEvent) => on.close(ev.code, ev.reason);
  ws.onerror = () => on.error("the connection failed");
  return {
    send: (data) => ws.send(data),
    close: (code) => ws.close(code),
    get open() {
      return ws.readyState === WebSocket.OPEN;
    },
    keyInHeader: false,
  };
}

async function openNode(url: string, apiKey: string | undefined, on: SocketEvents, sessionId?: string): Promise<Socket> {
  const { default: NodeWebSocket } = await import("ws");
  const headers: Record<string, string> = apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
  if (sessionId) headers[SESSION_HEADER] = sessionId; // a resume: a fleet's router finds its holder by it
  const ws = new NodeWebSocket(url, { headers, maxPayload: MAX_FRAME });
  await new Promise<void>((resolve, reject) => {
    ws.once("open", () => resolve());
    ws.once("error", (e: Error) => reject(new Error(`cannot reach the verifier at ${url}: ${e.message}`)));
  });
  ws.on("message", (data: Buffer, isBinary: boolean) => on.message(isBinary ? new Uint8Array(data) : null));
  ws.on("close", (code: number, reason: Buffer) => on.close(code, reason.toString()));
  ws.on("error", (e: Error) => on.error(e.message));
  return {
    send: (data) => ws.send(data),
    close: (code) => ws.close(code),
    get open() {
      return ws.readyState === NodeWebSocket.OPEN;
    },
    keyInHeader: true,
  };
}
