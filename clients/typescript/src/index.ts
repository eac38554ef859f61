export {
  type AutoPlan,
  choosePlan,
  CLIENT_FEATURES,
  costAt,
  DEFAULT_PLAN,
  type Objective,
  type Pricing,
  type Conditional,
  ConnectionLost,
  type ConnectOptions,
  DEFAULT_RESUME,
  GenerationError,
  type ResumeOptions,
  TreespecClient,
  type GenerateOptions,
  type Stats,
  type TreeSource,
  type VerdictInfo,
} from "./client.js";
export {
  chooseBudget,
  draftDynamic,
  type DynamicTree,
  nextGains,
  verifyMs,
  coupledChildren,
  draftConditional,
  draftStatic,
  likeliestOutcome,
  EXPORT_FORMAT,
  ExportError,
  folderReader,
  type Manifest,
  OnnxDrafter,
  type OrtLike,
  readManifest,
  topK,
} from "./onnx_drafter.js";
export { continuations, DEFAULT_LOOKUP, fitTree, lookupTree, type LookupOptions } from "./lookup.js";
export {
  decodeMessage, encodeMessage, FEATURE_COST, FEATURE_GAP_MS, FEATURE_PENDING_BYTES, FEATURE_RESUME, FEATURE_STREAM, FEATURE_WELCOME_FEATURES,
  type Message, ProtocolError, PROTOCOL_VERSION,
} from "./protocol.js";  // prettier-ignore
export { ClientChecks, reroot, rerootPath, treeMatches } from "./checks.js";
export { type Coupling, coupledToken, keyedUniform } from "./coupling.js";
export { couplingOf, DEFAULT_TREE, Edge, type EdgeOptions, type Prompt, type TextOptions } from "./edge.js";
export { type ChatMessage, TextCodec } from "./text.js";
export { inBrowser, openSocket, type Socket } from "./socket.js";
export { webReader, type WebReader, type WebReaderOptions } from "./web.js";
