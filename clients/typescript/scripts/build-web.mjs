// `npm run build:web`: the browser edge as a static folder, dist/web/ (what `edge-client serve
// --web-draft` serves at /edge/, and what a web app can copy and serve itself):
//   index.html          the page (web/index.html)
//   edge-page.js        the page's script, bundled with onnxruntime-web (WASM)
//   treespec-edge.js    the SDK alone (Edge, webReader, TreespecClient, ...) as one ES module, for apps
//                       without a bundler; bring your own onnxruntime-web module
//   ort/                onnxruntime-web's .wasm, its loader and its ES module (ort.wasm.min.mjs, for pages
//                       that import treespec-edge.js), served from the same origin (no CDN)
import { build } from "esbuild";
import { copyFileSync, mkdirSync, readdirSync, rmSync } from "node:fs";
import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const out = join(root, "dist", "web");
rmSync(out, { recursive: true, force: true });
mkdirSync(join(out, "ort"), { recursive: true });

const common = {
  bundle: true,
  format: "esm",
  platform: "browser",
  target: "es2022",
  // Node-only paths (the `ws` socket, folderReader's fs) are never taken in a browser
  external: ["ws", "node:*", "onnxruntime-node"],
  logLevel: "warning",
  minify: true,
  sourcemap: true,
};
await build({ ...common, entryPoints: [join(root, "src", "page.ts")], outfile: join(out, "edge-page.js") });
await build({ ...common, entryPoints: [join(root, "src", "index.ts")], outfile: join(out, "treespec-edge.js") });
copyFileSync(join(root, "web", "index.html"), join(out, "index.html"));

// the WASM runtime the page's ort.env.wasm.wasmPaths points at
const require = createRequire(import.meta.url);
const dist = dirname(require.resolve("onnxruntime-web/wasm"));
let copied = 0;
for (const f of readdirSync(dist)) {
  if (/^(ort-wasm-simd-threaded\.(wasm|mjs)|ort\.wasm\.min\.mjs)$/.test(f)) {
    copyFileSync(join(dist, f), join(out, "ort", f));
    copied++;
  }
}
if (copied !== 3) throw new Error(`onnxruntime-web: expected ort-wasm-simd-threaded.wasm, .mjs and ort.wasm.min.mjs in ${dist}`);
console.log(`browser bundle: ${out}`);
