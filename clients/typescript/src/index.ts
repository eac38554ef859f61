export { GenerationError, TreespecClient, type GenerateOptions, type Stats } from "./client.js";
export { continuations, DEFAULT_LOOKUP, fitTree, lookupTree, type LookupOptions } from "./lookup.js";
export { decodeMessage, encodeMessage, type Message, ProtocolError, PROTOCOL_VERSION } from "./protocol.js";
