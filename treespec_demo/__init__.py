"""The product's demo: `make demo` (or `treespec-demo`, `python -m treespec_demo`) starts the cloud
verifier and runs the edge client against it on localhost, on the real pair, and prints how `ar`
and `auto` compare. It sits above every other package (it starts both sides and measures them with
bench's library)."""
