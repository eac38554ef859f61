"""The ONNX tooling of the edge: a draft model written as an ONNX graph for onnxruntime.

`export` (the `edge-client export-onnx` command: the folder and the cache of exports),
`manifest` (an export's manifest: writing, reading and checking it, naming a source's cached
export), `graph` (the opset-18 graph with the KV cache as inputs and outputs) and `quant` (the
8-bit blocks of `--int8`). The drafter that runs an export is `edge_client.drafters.onnx_drafter`.
Importing this package imports neither torch nor onnx; each module imports them when used.
"""
